"""The ``specserve`` command.

``specserve generate`` runs the engine in this process (no Ray) and prints the text and the
speculation stats. With no model flags it serves the embedded default (SmolLM2-135M-Instruct)
with the n-gram proposer. Bad input ends with one readable line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import typing
from pathlib import Path

from pydantic import ValidationError

from specserve.errors import SpecServeError
from specserve.serve.local import DEFAULT_METRICS_PORT  # (sets the loopback env before any ray import)

log = logging.getLogger("specserve")


def _generate_parser(sub) -> None:
    from specserve.config import EngineConfig, ModelConfig, SamplingParams, SpeculativeConfig
    from specserve.methods import METHODS

    p = sub.add_parser("generate", help="generate text in-process and print the speculation stats")
    p.add_argument("--prompt", required=True, help="the prompt (a user message with --chat)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--model", default=_default(ModelConfig, "source"),
                   help="target: 'embedded', a .gguf file, a HF directory or a hub id")
    p.add_argument("--method", default=_default(SpeculativeConfig, "method"),
                   choices=["off", *METHODS], help="proposer (off: target-only)")
    p.add_argument("--draft", help="draft for --method draft_model (a model of the same tokenizer or "
                                    "a decoder draft) or eagle (an eagle draft), from train-draft")
    p.add_argument("-k", "--num-speculative-tokens", type=int, dest="k",
                   default=_default(SpeculativeConfig, "num_speculative_tokens"),
                   help="K: tokens drafted per step")
    # The CLI's own defaults: a short greedy answer (the API's are OpenAI's: temperature 1).
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=_default(SamplingParams, "top_p"))
    p.add_argument("--top-k", type=int, default=_default(SamplingParams, "top_k"))
    for name in ("min_p", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = _default(SamplingParams, name)
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--bad-word", action="append", default=[], help="never in the output (repeatable)")
    p.add_argument("--dtype", default=_default(ModelConfig, "dtype"), choices=_choices(ModelConfig, "dtype"))
    p.add_argument("--max-model-len", type=int, default=_default(EngineConfig, "max_model_len"))
    p.add_argument("--cache-dir", help="where dequantized GGUF models are cached")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=cmd_generate)


def _default(model, field: str):
    """A flag's default: the pydantic field's (the config is the one source of them)."""
    return model.model_fields[field].default


def _choices(model, field: str) -> list[str]:
    """A flag's choices: the values of the pydantic field's ``Literal``."""
    return list(typing.get_args(model.model_fields[field].annotation))


def _engine_config(args):
    from specserve.config import EngineConfig

    target = {"source": args.model, "dtype": args.dtype, "cache_dir": args.cache_dir}
    spec: dict = {"method": None if args.method == "off" else args.method,
                  "num_speculative_tokens": args.k}
    if args.draft:
        spec["draft"] = {"source": args.draft, "dtype": args.dtype, "cache_dir": args.cache_dir}
    return EngineConfig.model_validate({"target": target, "speculative": spec,
                                        "max_model_len": args.max_model_len, "max_num_seqs": 1})


def cmd_generate(args) -> int:
    from specserve.config import SamplingParams
    from specserve.engine.builder import build_engine
    from specserve.engine.tokenizer import encode_chat, encode_prompt

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            stop=tuple(args.stop), min_p=args.min_p, min_tokens=args.min_tokens,
                            presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty,
                            repetition_penalty=args.repetition_penalty, bad_words=tuple(args.bad_word))
    config = _engine_config(args)  # validated before any model loads
    engine, target = build_engine(config)
    tok = target.tokenizer
    prompt = (encode_chat(tok, [{"role": "user", "content": args.prompt}]) if args.chat
              else encode_prompt(tok, args.prompt))
    start = time.perf_counter()
    [done] = engine.generate([prompt], params)
    seconds = time.perf_counter() - start
    report = {"model": target.name, "method": args.method, "k": args.k, "text": done.text,
              "finish_reason": done.finish_reason, "prompt_tokens": len(prompt),
              "completion_tokens": len(done.output_token_ids), "seconds": round(seconds, 3),
              "tokens_per_second": round(len(done.output_token_ids) / seconds, 2),
              **done.stats.as_dict()}
    if args.json:
        print(json.dumps(report))
    else:
        print(done.text)
        print("---", file=sys.stderr)
        print(" ".join(f"{k}={v}" for k, v in report.items() if k != "text"), file=sys.stderr)
    return 0


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible API with a local Ray cluster")
    p.add_argument("--config", help="a Serve config YAML (deploy/serve_config.yaml) or an AppConfig "
                                    "YAML; default: the embedded model with n-gram speculation")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--metrics-port", type=int,
                   help=f"Ray's metrics export port (default: {DEFAULT_METRICS_PORT}, which "
                        "deploy/prometheus/prometheus.yml scrapes, or a free one near it, printed, "
                        "when another process holds it)")
    p.add_argument("--proxy-only", action="store_true",
                   help="serve --port through Serve's proxy even where the unit runs in the "
                        "ingress replica (which then serves --port itself: one hop less a token)")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from specserve.serve.server import serve

    return serve(args)


def _dashboards_parser(sub) -> None:
    p = sub.add_parser("dashboards", help="Grafana dashboards")
    dsub = p.add_subparsers(dest="action", required=True)
    push = dsub.add_parser("push", help="create or overwrite the dashboards in a Grafana (by uid)")
    push.add_argument("--url", required=True, help="Grafana's base URL, e.g. http://127.0.0.1:3000")
    push.add_argument("--token", required=True, help="a Grafana service-account token (Editor)")
    push.add_argument("--folder", help="folder title; created when missing (default: General)")
    push.add_argument("--timeout", type=float, default=10.0, help="seconds per API call")
    push.set_defaults(func=cmd_dashboards_push)


def cmd_dashboards_push(args) -> int:
    from specserve.dashboards import push

    for r in push(args.url, args.token, args.folder, timeout_s=args.timeout):
        print(f"{r['file']}: uid={r['uid']} version={r['version']} {r['url']}")
    return 0


def _train_draft_parser(sub) -> None:
    from specserve.training.options import add_arguments

    p = sub.add_parser("train-draft", help="train a draft by self-distillation on the target's outputs")
    add_arguments(p)
    p.add_argument("--json", action="store_true", help="print the evaluation as JSON")
    p.set_defaults(func=cmd_train_draft)


def cmd_train_draft(args) -> int:
    from specserve.training.pipeline import run, summary_lines

    report = run(args)
    print(json.dumps(report, indent=2) if args.json else "\n".join(summary_lines(report)))
    return 0


def _preflight_parser(sub) -> None:
    p = sub.add_parser("preflight", help="before `helm install`: whether the cluster can place the "
                                         "values' units, and everything else they need")
    p.add_argument("-f", "--values", action="append", default=[], metavar="FILE",
                   help="a values file, as given to helm install (repeatable, merged in order)")
    p.add_argument("--chart", default=str(CHART) if CHART.is_dir() else None,
                   help="the chart, whose values.yaml the files override (default: this checkout's; "
                        "'' for none: the files hold every value)")
    p.add_argument("-n", "--namespace", default="default", help="the release's namespace (its secrets)")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
    p.add_argument("--context", help="kubeconfig context (default: the current one)")
    p.add_argument("--in-cluster", action="store_true", help="use the pod's service account (the Helm hook)")
    p.set_defaults(func=cmd_preflight)


CHART = Path(__file__).resolve().parents[2] / "helm" / "specserve"


def cmd_preflight(args) -> int:
    """One line per finding; exit 1 when the deployment cannot come up, 2 for bad input."""
    from specserve.kube.cluster import connect, read_cluster
    from specserve.kube.needs import load_values, needs_of
    from specserve.kube.preflight import can_come_up, preflight

    needs = needs_of(load_values([Path(f) for f in args.values], Path(args.chart) if args.chart else None))
    api = connect(kubeconfig=args.kubeconfig, context=args.context, in_cluster=args.in_cluster)
    view = read_cluster(api, args.namespace, [s.name for s in needs.secrets])
    findings, units = preflight(needs, view.nodes, view.crds, view.storage_classes, view.secrets,
                                args.namespace)
    for finding in findings:
        print(finding.line())
    ok = can_come_up(findings)
    print(f"specserve: {'the deployment can come up' if ok else 'the deployment cannot come up'} "
          f"({units} of {needs.units} unit(s) fit)")
    return 0 if ok else 1


def _status_parser(sub) -> None:
    p = sub.add_parser("status", help="after `helm install`: what the cluster is doing with a release "
                                      "(RayService, Serve app, unit pods and why they wait, endpoints)")
    p.add_argument("release", nargs="?", default="specserve", help="the Helm release (default: specserve)")
    p.add_argument("-n", "--namespace", default="default", help="the release's namespace")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
    p.add_argument("--context", help="kubeconfig context (default: the current one)")
    p.add_argument("-w", "--watch", action="store_true", help="reprint every --interval seconds until Ctrl-C")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between rounds of --watch")
    p.add_argument("--max-rounds", type=int, help=argparse.SUPPRESS)  # tests: a bounded --watch
    p.set_defaults(func=cmd_status)


def cmd_status(args) -> int:
    """One line per fact; exit 0 when the Serve app is RUNNING and every pod is ready, 1 while
    not, 2 for bad input. ``--watch`` reprints (an API error is then a line, not the end)
    until Ctrl-C, which exits 0; with ``--max-rounds``, the last round's status."""
    from specserve.errors import ConfigError
    from specserve.kube.cluster import connect
    from specserve.kube.status import read_status, report

    if args.interval <= 0:
        raise ConfigError(f"--interval must be positive, not {args.interval:g}")
    api = connect(kubeconfig=args.kubeconfig, context=args.context)
    rounds = 0
    try:
        while True:
            if args.watch:
                print(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} ---", flush=True)
            try:
                result = report(read_status(api, args.namespace, args.release))
            except SpecServeError as exc:
                if not args.watch:
                    raise
                print(f"specserve: error: {exc}", flush=True)
                code = 2
            else:
                print("\n".join(result.text()), flush=True)
                code = 0 if result.serving else 1
            rounds += 1
            if not args.watch or (args.max_rounds and rounds >= args.max_rounds):
                return code
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


def _memory_parser(sub) -> None:
    from specserve.config import EngineConfig, KVCacheConfig, ModelConfig, SpeculativeConfig, UnitConfig

    p = sub.add_parser("memory-estimate", help="GPU memory per rank of a target (and its draft), "
                                               "from config.json (docs/MEMORY.md)")
    p.add_argument("--config", required=True, help="the target's config.json, or its model directory")
    p.add_argument("--draft-config", help="the draft's config.json or directory (one GPU of its own)")
    p.add_argument("--tp", type=int, default=_default(UnitConfig, "tensor_parallel_size"),
                   choices=_choices(UnitConfig, "tensor_parallel_size"), help="target tensor parallel size")
    p.add_argument("--dtype", default=_default(ModelConfig, "dtype"), choices=_choices(ModelConfig, "dtype"),
                   help="auto: bfloat16 (the estimate is for CUDA)")
    p.add_argument("--max-model-len", type=int, default=_default(EngineConfig, "max_model_len"))
    p.add_argument("--max-num-seqs", type=int, default=_default(EngineConfig, "max_num_seqs"))
    p.add_argument("-k", "--num-speculative-tokens", type=int, dest="k",
                   default=_default(SpeculativeConfig, "num_speculative_tokens"))
    p.add_argument("--kv-layout", default=_default(KVCacheConfig, "layout"),
                   choices=_choices(KVCacheConfig, "layout"),
                   help="the target's KV cache: a slot per sequence, or a paged pool of blocks "
                        "(auto: what a GPU gets, slots, until a GPU run measures paged)")
    p.add_argument("--block-size", type=int,
                   help="paged: positions per block (default on a GPU: 64, FlexAttention's key block)")
    p.add_argument("--kv-blocks", type=int,
                   help="paged: blocks in the pool (default: the slots' memory, "
                        "max_num_seqs x max_model_len)")
    p.add_argument("--prefill-rows", type=int, default=1,
                   help="prompts of full length prefilled in one forward (same-length prompts share one)")
    p.add_argument("--gpu-memory-gib", type=float,
                   help="memory of one GPU as CUDA counts it (an 80 GB H100: 79); exit 1 if it does not fit")
    p.add_argument("--draft-gpu-memory-gib", type=float,
                   help="the draft's GPU, if another kind (default: --gpu-memory-gib)")
    p.add_argument("--draft-placement", choices=_choices(UnitConfig, "draft_placement"),
                   default=_default(UnitConfig, "draft_placement"),
                   help="unit.draft_placement: shared counts target rank 0 and the draft on one "
                        "GPU together; own gives the draft a GPU of its own")
    p.set_defaults(func=cmd_memory_estimate)


def _bound(model, field: str, which: str):
    """A bound (``ge``, ``le``) of a pydantic field."""
    return next(getattr(m, which) for m in model.model_fields[field].metadata if hasattr(m, which))


def _read_model_config(path: str) -> dict:
    """A ``config.json`` as a dict, from the file or the directory holding it."""
    from pathlib import Path

    file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    try:
        return json.loads(file.read_text())
    except OSError as exc:
        raise SpecServeError(f"cannot read {file}: {exc.strerror}") from exc
    except ValueError as exc:
        raise SpecServeError(f"{file} is not JSON: {exc}") from exc


def cmd_memory_estimate(args) -> int:
    from dataclasses import replace

    from specserve.config import EngineConfig
    from specserve.memory import (
        GIB,
        ModelShape,
        Workload,
        compiled,
        estimate,
        format_estimate,
        largest_kv_blocks,
        largest_num_seqs,
        largest_shared_num_seqs,
        shared_gpu,
    )

    kv = {"layout": args.kv_layout, "num_blocks": args.kv_blocks,
          **({} if args.block_size is None else {"block_size": args.block_size})}
    cfg = EngineConfig.model_validate({"max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
                                       "speculative": {"num_speculative_tokens": args.k},
                                       "kv_cache": kv}).for_device("cuda")  # the same checks; a GPU
    gpus = [gib * GIB if gib else None for gib in (args.gpu_memory_gib, args.draft_gpu_memory_gib)]
    roles = [("target", args.config, args.tp, False, gpus[0])]
    if args.draft_config:
        roles.append(("draft", args.draft_config, 1, True, gpus[1] or gpus[0]))
    fits, sized = True, []
    for role, path, tp, draft, gpu in roles:
        shape = ModelShape.from_config(_read_model_config(path))
        kv = cfg.draft_kv_cache if draft else cfg.kv_cache
        paged = kv is not None and kv.layout == "paged"
        load = Workload(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                        num_speculative_tokens=args.k, tp=tp, dtype=args.dtype, draft=draft, paged=paged,
                        prefill_rows=args.prefill_rows, kv_blocks=kv.num_blocks if paged else None,
                        spare_slot=compiled("auto", "cuda", draft),  # kernels auto, on a GPU
                        block_size=kv.block_size if paged else cfg.kv_cache.block_size)
        est = estimate(shape, load)
        sized.append((shape, load))
        dtype = "auto = bfloat16" if args.dtype == "auto" else args.dtype
        print(f"{role} {path}: tp {tp}, {dtype}, max_model_len {args.max_model_len}, "
              f"max_num_seqs {args.max_num_seqs}, K {args.k}; per GPU:")
        print(format_estimate(est, gpu_memory_bytes=gpu, load=load))
        if gpu is not None:
            most = replace(load, max_num_seqs=_bound(EngineConfig, "max_num_seqs", "le"))
            print(f"  largest max_num_seqs that fits: {largest_num_seqs(shape, most, gpu)}")
            if load.paged and load.kv_blocks is not None and not draft:
                print(f"  largest kv_cache.num_blocks that fits: {largest_kv_blocks(shape, load, gpu)}")
            fits = fits and est.fits(gpu)
    if args.draft_placement == "shared" and len(sized) == 2:
        both = shared_gpu(*sized, gpus[0])
        print(both.line())
        if gpus[0] is not None:
            top = _bound(EngineConfig, "max_num_seqs", "le")
            (target, target_load), (draft, draft_load) = sized
            most = largest_shared_num_seqs((target, replace(target_load, max_num_seqs=top)),
                                           (draft, replace(draft_load, max_num_seqs=top)), gpus[0])
            print(f"  largest max_num_seqs that fits both: {most} (else draft_placement own)")
        fits = fits and both.fits
    return 0 if fits else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _serve_parser(sub)
    _dashboards_parser(sub)
    _train_draft_parser(sub)
    _memory_parser(sub)
    _preflight_parser(sub)
    _status_parser(sub)
    return parser


def _one_line(exc: ValidationError) -> str:
    """The first pydantic error as ``field.path: message``."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    return f"{where}: {msg}" if where else msg


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # (serve re-runs itself with them)
    # force: each call (tests call main in one process) writes to the sys.stderr of now, not
    # to the stream of the first call, which may be closed by then.
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", force=True)
    try:
        return args.func(args)
    except ValidationError as exc:
        print(f"specserve: error: {_one_line(exc)}", file=sys.stderr)
    except SpecServeError as exc:
        print(f"specserve: error: {exc}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
