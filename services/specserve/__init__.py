"""specserve: lossless speculative decoding served by Ray Serve.

The pure-torch engine lives in :mod:`specserve.engine` (its docstring fixes the vocabulary
used everywhere else); configuration in :mod:`specserve.config`; the command line in
:mod:`specserve.cli`.
"""

__version__ = "0.1.0"
