"""The `loraplex` command: `generate` (offline, one prompt), `serve` (the HTTP server) and `run-batch` (a
file in OpenAI's Batch API format through the server, frontends/run_batch.py)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from engine import envs
from engine.serving.adapter_dir import register_adapter_dir
from engine.waiting_queue import POLICIES
from frontends.auth import parse_auth
from kernels.selector import BACKENDS, DEVICES


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="'default' (SmolLM2-135M-Instruct) or a Hugging Face model directory of a served family")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 or float32")
    p.add_argument("--backend", default=None, choices=BACKENDS,
                   help="compute backend: auto (default), cpu (C kernels), torch (reference), triton")
    p.add_argument("--device", default=None, choices=DEVICES, help="auto (default: CUDA when present), cpu or cuda")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-loras", type=int, default=None,
                   help="distinct adapters in one step (default: as many as the pool holds)")
    p.add_argument("--max-lora-rank", type=int, default=None)
    p.add_argument("--max-cpu-loras", type=int, default=None, help="adapters kept in the host-memory tier")
    p.add_argument("--host-tier-dtype", default=None, choices=("auto", "int8"),
                   help="host-tier copies in the model's dtype (auto, default) or int8 (twice the adapters, lossy)")
    p.add_argument("--max-adapters-per-request", type=int, default=None,
                   help="adapters one request may compose with `adapters` (default 4)")
    p.add_argument("--loader-threads", type=int, default=None,
                   help="threads loading adapters beside the steps (default 1)")
    p.add_argument("--adapter-dir", default=None,
                   help="serve every subfolder holding a PEFT adapter under the folder's name (read when first used)")
    p.add_argument("--scheduling-policy", choices=tuple(POLICIES), default=None,
                   help="vtc (default): the tenant served the fewest tokens goes next; fair: the fewest running; fcfs")


def check_source(url: str | None) -> str | None:
    """--adapter-source, checked before anything starts."""
    if url and not url.startswith(("http://", "https://", "hf://")):
        raise ValueError(f"--adapter-source: {url!r} is not an http://, https:// or hf:// URL")
    if url and url.startswith("hf://"):
        from engine.serving.adapter_source import hub_url
        hub_url(url, "")
    return url


def _server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--adapter-source", default=None,
                   help="an http(s) URL adapters are fetched from when a request names one the server does not "
                        "have: URL/<name>/adapter_config.json and adapter_model.safetensors, or a URL with {name}; "
                        "hf://ORG: the Hugging Face Hub's ORG/<name> repositories")
    from frontends.tool_parsers import PARSERS
    p.add_argument("--chat-template", default=None,
                   help="a Jinja file to render chat messages with instead of the model's own template")
    p.add_argument("--tool-call-parser", default=None, choices=tuple(PARSERS),
                   help="how the model writes tool calls, for tool_choice 'auto' (hermes: <tool_call> blocks, as "
                        "Hermes and Qwen; llama3_json: a JSON object, as Llama 3.1; mistral: [TOOL_CALLS] and a "
                        "JSON array; pythonic: a Python list of calls, as Llama 3.2 and 4)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines: tool_choice 'auto' is on whenever --tool-call-parser is")


def chat_argv(args: argparse.Namespace) -> list[str]:
    """The frontends' flags for chat: --chat-template (checked here: readable Jinja) and --tool-call-parser."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json, mistral or "
                         "pythonic)")
    out = ["--tool-call-parser", args.tool_call_parser] if args.tool_call_parser else []
    if args.chat_template:
        from jinja2 import Environment, TemplateSyntaxError

        from engine.tokenizer import read_chat_template
        try:
            Environment().parse(read_chat_template(args.chat_template))
        except TemplateSyntaxError as e:
            raise ValueError(f"--chat-template: {args.chat_template} line {e.lineno}: {e.message}") from None
        out += ["--chat-template", os.path.abspath(args.chat_template)]
    return out


def engine_kwargs(args: argparse.Namespace) -> dict:
    names = ("backend", "device", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes", "block_size",
             "max_model_len", "max_loras", "max_lora_rank", "max_cpu_loras", "loader_threads", "scheduling_policy",
             "host_tier_dtype", "max_adapters_per_request")
    kw = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    return dict(model=args.model, dtype=args.dtype, **kw)


def _generate(args: argparse.Namespace) -> int:
    from engine.llm import LLM
    from ipc.sampling_params import SamplingParams
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens, stop=args.stop or [], ignore_eos=args.ignore_eos)
    llm = LLM(**engine_kwargs(args))
    if args.adapter_dir:
        _, refused = register_adapter_dir(llm.engine, args.adapter_dir)
        if args.adapter in refused:
            raise ValueError(f"adapter {args.adapter!r} was refused: {refused[args.adapter]}")
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, adapter=args.adapter)[0]
    else:
        out = llm.generate(args.prompt, params, adapter=args.adapter)[0]
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason}))
    else:
        print(out.text)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from frontends.launcher import serve
    if args.replicas > 1:
        if args.replica_load_bound < 0:
            raise ValueError(f"--replica-load-bound must be >= 0, got {args.replica_load_bound}")
        if args.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
        from frontends.ray_launcher import serve_on_ray
        return serve_on_ray(args.argv, args.replicas, args.max_adapters_per_replica, args.host, args.port,
                            args.ray_address, args.replica_routing, args.replica_load_bound, args.shutdown_timeout)
    kwargs = engine_kwargs(args)
    if args.adapter_dir:
        kwargs.pop("adapter_dir", None)
    if args.max_waiting < 1:
        raise ValueError(f"--max-waiting must be >= 1, got {args.max_waiting}")
    loading = {"lora_roots": args.lora_roots or [], "runtime_lora": not args.disable_runtime_lora,
               "max_waiting": args.max_waiting, "adapter_source": check_source(args.adapter_source)}
    args.auth = _with_metrics_key(args.auth, args.metrics_key)
    parse_auth(args.auth, args.api_key)                # a bad [auth] table stops here, naming the setting
    source = (lambda: _with_metrics_key(_read_auth(args.config), args.metrics_key)) if args.config else None
    if args.stream_timeout <= 0 or args.stream_buffer < 1:
        raise ValueError(f"--stream-timeout must be > 0 and --stream-buffer >= 1, got {args.stream_timeout} and "
                         f"{args.stream_buffer}")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    return serve(kwargs, args.adapter_dir, args.host, args.port, args.frontends, args.api_key, loading, args.auth,
                 (args.stream_timeout, args.stream_buffer), shutdown_timeout=args.shutdown_timeout,
                 log_requests=args.enable_log_requests, auth_source=source, chat_args=chat_argv(args))


def _with_metrics_key(table: dict | None, metrics_key: str | None) -> dict | None:
    """The [auth] table with --metrics-key as one more metrics key, beside the table's own."""
    if not metrics_key:
        return table
    table = dict(table or {})
    return {**table, "metrics_keys": [*table.get("metrics_keys", []), metrics_key]}


def _read_auth(path: str) -> dict | None:
    """The config file's [auth] table as it is now (SIGHUP: frontends/auth_reload.py)."""
    import tomllib
    with open(path, "rb") as f:
        return tomllib.load(f).get("auth")


def _apply_config(parser: argparse.ArgumentParser, argv: list[str] | None) -> None:
    """--config FILE (TOML): its keys become defaults of the subcommand; flags given win."""
    import tomllib
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if not known.config:
        return
    try:
        data = tomllib.loads(open(known.config).read())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise SystemExit(f"loraplex: error: --config {known.config}: {e}")
    sub = parser._subparsers._group_actions[0].choices
    sub["serve"].set_defaults(auth=data.pop("auth", None))     # the [auth] table (frontends/auth.py)
    for name, sp in sub.items():
        valid = {a.dest for a in sp._actions}
        unknown = sorted(set(k.replace("-", "_") for k in data) - valid)
        if unknown and name == "serve":
            raise SystemExit(f"loraplex: error: --config {known.config}: unknown setting(s) {', '.join(unknown)}")
        sp.set_defaults(**{k.replace("-", "_"): v for k, v in data.items() if k.replace("-", "_") in valid})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex", description="Serve many LoRA adapters on one base LLM.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt, offline")
    _engine_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, finish_reason")
    g.add_argument("--adapter", default=None, help="name of a registered adapter to generate with")
    g.set_defaults(func=_generate)
    s = sub.add_parser("serve", help="start the OpenAI-compatible server (one engine, N frontends)")
    _engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    s.add_argument("--frontends", type=int, default=2, help="HTTP frontend processes sharing the port")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    s.add_argument("--metrics-key", default=None,
                   help="a key that may read /metrics and nothing else (with keys configured, /metrics needs an "
                        "admin key or this one)")
    s.add_argument("--config", default=None, help="TOML file of settings (flags win)")
    s.add_argument("--lora-roots", nargs="*", default=None,
                   help="folders besides --adapter-dir that /v1/load_lora_adapter may load from")
    s.add_argument("--max-waiting", type=int, default=1024,
                   help="requests waiting in the engine beyond which new ones get a 429 with Retry-After")
    s.add_argument("--disable-runtime-lora", action="store_true",
                   help="refuse /v1/load_lora_adapter and /v1/unload_lora_adapter")
    s.add_argument("--stream-timeout", type=float, default=60.0,
                   help="seconds a streaming client may take nothing before it is aborted (its pages freed)")
    s.add_argument("--stream-buffer", type=int, default=1024,
                   help="outputs of one request that may wait for a slow client before it is aborted")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM / SIGINT: stop taking connections, give running requests this many seconds "
                        "to finish, then stop the engine (keep it below your orchestrator's grace period)")
    _server_args(s)
    s.add_argument("--enable-log-requests", action="store_true",
                   help="log one JSON line per POST /v1/* request (id, tenant, model, status, tokens, times; "
                        "no prompt or text)")
    s.add_argument("--replicas", type=int, default=1,
                   help=">= 2: that many engine replicas behind one endpoint on Ray Serve (pip install loraplex[ray])")
    s.add_argument("--ray-address", default=None, help="the Ray cluster to join (default: start a local one)")
    s.add_argument("--max-adapters-per-replica", type=int, default=64,
                   help="adapters Ray Serve routes to one replica before it sends them elsewhere")
    s.add_argument("--replica-routing", choices=("adapter", "random"), default="adapter",
                   help="random: ignore adapters when picking a replica (for comparison)")
    s.add_argument("--replica-load-bound", type=float, default=0.0,
                   help="e.g. 1.25: an adapter's requests leave its replica while that replica carries more than "
                        "this times the mean load, plus one (0, the default: always follow the adapter)")
    s.set_defaults(func=_serve, auth=None)
    b = sub.add_parser("run-batch", help="run a file of requests in OpenAI's Batch API format (JSONL) through the "
                                         "server; write one answer per line")
    _engine_args(b)
    b.add_argument("-i", "--input", required=True, help="the requests, one JSON object a line ('-': stdin)")
    b.add_argument("-o", "--output", required=True, help="where the answers go, in the input's order ('-': stdout)")
    b.add_argument("--max-concurrency", type=int, default=64, help="requests in flight at once")
    _server_args(b)
    b.set_defaults(func=_run_batch)
    return parser


def _run_batch(args: argparse.Namespace) -> int:
    from frontends.run_batch import run
    return run(args)


def serve_setting(serve_args: list[str], name: str):
    """The value `loraplex serve <serve_args>` would run with for setting `name` (flags, a --config file,
    the defaults): what the Ray application needs to know of its replicas' servers."""
    parser = build_parser()
    argv = ["serve", *serve_args]
    _apply_config(parser, argv)
    return getattr(parser.parse_args(argv), name)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=envs.log_level(), format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    parser = build_parser()
    _apply_config(parser, argv)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.func(args)
    except (ValueError, LookupError) as e:
        print(f"loraplex: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
