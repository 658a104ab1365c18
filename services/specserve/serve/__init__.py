"""The Ray Serve application: speculation units, their request router, the OpenAI ingress.

Request path: HTTP → :mod:`.ingress` (FastAPI) → a :mod:`.unit` replica chosen by
:mod:`.request_router` (prefix affinity, least load) → its coordinator (:mod:`.coordinator`) driving the draft
and target groups (:mod:`.groups`).
"""
