"""`tokenmill serve [MODEL]`: the OpenAI-compatible server (FastAPI + uvicorn) over one engine."""
from __future__ import annotations

import argparse
import os
import socket
import time

from typing import Any, Optional


def register(subparsers: Any) -> None:
    from tokenmill.cli import add_engine_args
    p = subparsers.add_parser("serve", help="serve the OpenAI API (/v1/completions, /v1/chat/completions) and a "
                                            "playground page")
    p.add_argument("model", nargs="?", default=None,
                   help="HF folder or .gguf (default: bundled SmolLM2-135M-Instruct)")
    # the habits users paste from vLLM and llama-server
    p.add_argument("--model", "-m", dest="model_option", default=None,
                   help="the model, as the positional argument (vLLM's --model, llama-server's -m)")
    p.add_argument("-hf", "--hf-repo", dest="hf_repo", default=None,
                   help="llama-server's hub repository (user/repo[:QUANT]), as the model")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or a file holding one, in place of the model's (vLLM's flag)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines: tool calls are always parsed when a request sends tools")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM's command lines: tokenmill runs no code from model folders")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters to serve, each as name=path or vLLM's JSON {\"name\": ..., \"path\": ...}; "
                        "a request's model field picks one by name (implies --enable-lora)")
    p.add_argument("--lora", action="append", default=None, metavar="PATH",
                   help="llama-server's spelling: a LoRA adapter (a PEFT folder), served under its folder's name")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--api-key", default=os.environ.get("TOKENMILL_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $TOKENMILL_API_KEY, else none)")
    p.add_argument("--served-model-name", default=None, help="the name clients use (default: the model's file)")
    p.add_argument("--max-queue", type=int, default=None,
                   help="answer 503 while this many requests are already waiting (default: no bound)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 2 ** 20, help="answer 413 to larger request bodies")
    p.add_argument("--max-prompts-per-request", type=int, default=128,
                   help="answer 400 to a completions request with more prompts than this (like OpenAI's cap on n)")
    p.add_argument("--no-report-cached-tokens", dest="report_cached_tokens", action="store_false",
                   help="report usage's cached_tokens as 0: with a prefix cache shared between clients, the count "
                        "tells a client which prompts others sent (cache_salt keeps requests apart instead)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM or Ctrl-C (or POST /shutdown), let the requests in flight finish for up to this "
                        "many seconds while new ones get 503, then end the rest and exit (0: at once); a second "
                        "signal ends everything at once")
    p.add_argument("--enable-shutdown-endpoint", action="store_true",
                   help="serve POST /shutdown, which drains and stops the server as SIGTERM does (it needs the API "
                        "key when one is set)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    from tokenmill.reasoning import REASONING_PARSERS
    from tokenmill.tool_parsers import TOOL_PARSER_NAMES
    p.add_argument("--tool-call-parser", default=None, choices=TOOL_PARSER_NAMES,
                   help="how tool calls are read from chat replies (tool_choice auto): hermes (<tool_call>{...}"
                        "</tool_call>) or llama3_json (Llama 3's JSON); default: the one the chat template's syntax "
                        "asks for, hermes for templates without tools")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split a reasoning model's <think>...</think> into reasoning_content on chat replies, and "
                        "start structured-output constraints after it: qwen3 | deepseek_r1 (the output starts in "
                        "the thinking)")
    from tokenmill.engine.router import ROUTING
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="serve with this many engine replicas, each on its own share of the cores (or its own GPU)")
    p.add_argument("--data-parallel-routing", default="cache_aware", choices=ROUTING,
                   help="which replica takes a request: cache_aware (the one that was sent the prompt's first "
                        "blocks, else the least loaded), round_robin, or least_loaded")
    p.add_argument("--nnodes", type=int, default=1,
                   help="machines the tensor-parallel ranks span, one rank each (torchrun's name): node 0 serves, "
                        "the others run its steps on their share of the model")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's rank among --nnodes")
    p.add_argument("--master-addr", default="127.0.0.1", help="node 0's address, which every node can reach")
    p.add_argument("--master-port", type=int, default=29500, help="a free port on node 0 for the rendezvous")
    from tokenmill.engine.kv_transfer import DEFAULT_PORT
    p.add_argument("--kv-role", choices=("prefill", "decode", "both"), default=None,
                   help="prefill and decode on separate instances: a prefill instance sends each prompt's KV to "
                        "the decode instance a request names; a decode instance receives it on kv_ip:kv_port "
                        f"(127.0.0.1:{DEFAULT_PORT} unless --kv-transfer-config says); `tokenmill router` pairs them")
    p.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help="vLLM's KV transfer config: {\"kv_role\": \"kv_producer\"|\"kv_consumer\"|\"kv_both\", "
                        "\"kv_connector\": \"TorchDistributedConnector\", \"kv_ip\": ..., \"kv_port\": ...}; "
                        "--kv-role overrides its kv_role")
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)


def _bind(host: str, port: int) -> socket.socket:
    """Bind and listen before loading the model: a busy port fails in a second, not after the load; with
    --port 0 the URL printed is the real one; and a client that connects as soon as the URL is printed
    waits in the backlog until uvicorn accepts, instead of being refused."""
    # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and without it each
    # response's body (a stream's first token too) waits for the client's delayed ACK of its headers
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port "
                         f"(0 picks a free one)") from e
    return sock


def _join_nodes(args: argparse.Namespace) -> bool:
    """Several machines, one rank each, over one rendezvous at --master-addr:--master-port, as torchrun would set
    it up. Node 0 goes on to serve (False); another node runs rank 0's steps until it stops (True)."""
    from tokenmill.executor.parallel import TPGroup, serve_rank
    n, rank = args.nnodes, args.node_rank
    if args.tensor_parallel_size != n:
        raise ValueError(f"--nnodes {n} runs one rank a machine: give --tensor-parallel-size {n} on every node "
                         f"(got {args.tensor_parallel_size})")
    if not 0 <= rank < n:
        raise ValueError(f"--node-rank must be in [0, {n}), got {rank}")
    if args.data_parallel_size != 1:
        raise ValueError("--nnodes splits one engine over machines; it does not combine with --data-parallel-size")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR=args.master_addr, MASTER_PORT=str(args.master_port))
    if rank == 0:
        return False
    print(f"tokenmill: rank {rank} of {n}, joining {args.master_addr}:{args.master_port}; node 0 serves", flush=True)
    serve_rank(TPGroup.from_env(n))
    return True


NO_EFFECT = {"enable_auto_tool_choice": "tool calls are always parsed when a request sends tools (the parser: "
                                       "--tool-call-parser, else the chat template's)",
             "trust_remote_code": "tokenmill runs no code from model folders; the architectures it knows are built "
                                  "in"}


def lora_requests(modules: list[str], paths: list[str]) -> list:
    """--lora-modules (name=path, or vLLM's JSON) and llama-server's --lora (a PEFT folder, named by it) as
    LoRARequests, numbered from 1."""
    import json

    from tokenmill.lora.request import LoRARequest
    named: list[tuple[str, str]] = []
    for m in modules:
        if m.lstrip().startswith("{"):
            try:
                d = json.loads(m)
                named.append((d["name"], d["path"]))
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules {m!r}: a JSON module needs \"name\" and \"path\"") from None
        elif "=" in m:
            name, path = m.split("=", 1)
            named.append((name, path))
        else:
            raise ValueError(f"--lora-modules {m!r}: give name=path (or JSON with name and path)")
    for path in paths:
        if path.endswith(".gguf"):
            raise ValueError(f"--lora {path!r}: a GGUF adapter is llama.cpp's format; tokenmill reads PEFT folders "
                             f"(adapter_config.json and adapter_model.safetensors): give the folder peft saved")
        named.append((os.path.basename(os.path.normpath(path)), path))
    names = [n for n, _ in named]
    dup = next((n for n in names if names.count(n) > 1 or not n), None)
    if dup is not None:
        raise ValueError(f"LoRA adapter name {dup!r} is empty or given twice; give each adapter its own name")
    return [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(named)]


def _habits(args: argparse.Namespace) -> None:
    """vLLM's and llama-server's spellings: --model and -m as the positional; --lora-modules and --lora as
    LoRARequests (turning --enable-lora on); flags that mean nothing here said once; what is not served (a GGUF
    adapter, adapters with data parallelism) refused with what to do instead."""
    for given in (args.model_option, args.hf_repo):
        if given is not None:
            if args.model is not None and args.model != given:
                raise ValueError(f"two models given: {args.model!r} and {given!r}; give one")
            args.model = given
    args.lora_requests = lora_requests(args.lora_modules or [], args.lora or [])
    if args.lora_requests and not args.enable_lora:
        print("tokenmill: --lora-modules/--lora given: adapters enabled (--enable-lora)", flush=True)
        args.enable_lora = True
    if args.enable_lora and args.data_parallel_size != 1:
        raise ValueError("--enable-lora with --data-parallel-size > 1 is not implemented; serve the adapters from "
                         "one replica")
    for name, why in NO_EFFECT.items():
        if getattr(args, name):
            print(f"tokenmill: --{name.replace('_', '-')} has no effect here: {why}", flush=True)
    if args.chat_template is not None:
        from tokenmill.tokenizer import check_chat_template
        if os.path.isfile(args.chat_template):
            with open(args.chat_template, encoding="utf-8") as f:
                args.chat_template = f.read()
        check_chat_template(args.chat_template)      # before the model loads


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from tokenmill.cli import engine_kwargs
    from tokenmill.engine.async_engine import AsyncLLM
    from tokenmill.engine.data_parallel import DataParallelLLM
    from tokenmill.server.app import build_app

    _habits(args)
    if args.nnodes > 1 and _join_nodes(args):
        return 0
    if args.max_queue is not None and args.max_queue < 0:
        raise ValueError("--max-queue must be >= 0")
    if args.max_body_bytes < 1:
        raise ValueError("--max-body-bytes must be >= 1")
    if not args.shutdown_timeout >= 0:
        raise ValueError("--shutdown-timeout must be >= 0")
    from tokenmill.engine.kv_transfer import KVTransferConfig
    transfer = KVTransferConfig.of(args.kv_transfer_config, args.kv_role)
    sock = _bind(args.host, args.port)
    if args.data_parallel_size == 1:
        llm = AsyncLLM.from_engine_args(args.model, **engine_kwargs(args), reasoning_parser=args.reasoning_parser,
                                        kv_transfer_config=transfer)
    else:
        llm = DataParallelLLM(args.model, args.data_parallel_size, args.data_parallel_routing,
                              **engine_kwargs(args), reasoning_parser=args.reasoning_parser,
                              kv_transfer_config=transfer)
        where = ", ".join(f"cores {','.join(map(str, c))}" if c else f"cuda:{i}" for i, c in enumerate(llm.cores))
        print(f"tokenmill: {args.data_parallel_size} data-parallel replicas ({where}), routing "
              f"{args.data_parallel_routing}", flush=True)
    engine = llm.engine
    app = build_app(llm, model_name=args.served_model_name, api_key=args.api_key, max_queue=args.max_queue,
                    max_body_bytes=args.max_body_bytes, tool_call_parser=args.tool_call_parser,
                    reasoning_parser=args.reasoning_parser, enable_shutdown_endpoint=args.enable_shutdown_endpoint,
                    max_prompts_per_request=args.max_prompts_per_request,
                    report_cached_tokens=args.report_cached_tokens, chat_template=args.chat_template,
                    lora_modules=args.lora_requests)
    timeout = args.shutdown_timeout

    class Server(uvicorn.Server):
        """A first SIGTERM or Ctrl-C (or POST /shutdown) drains: new requests get 503 while the listener stays
        open, those in flight run on for up to --shutdown-timeout seconds, then what is left gets an error and the
        process exits 0. A second signal does that at once; a third stops waiting for the connections too."""
        drain_since: Optional[float] = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            # uvicorn's own handler is not called: it records the signal, re-raises it once serving ends, and the
            # process dies by it instead of exiting 0. This runs between any two bytecodes: it only sets flags and
            # queues commands (the rest happens in on_tick)
            if not llm.draining and not self.should_exit:
                llm.drain()
            elif not self.should_exit:
                self.cut()
            else:
                self.force_exit = True

        def cut(self) -> None:
            """Fail the requests still in flight (each gets an error), so uvicorn's graceful wait ends."""
            llm.shutdown("the server is shutting down")
            self.should_exit = True

        async def on_tick(self, counter: int) -> bool:
            if llm.draining and not self.should_exit:
                if self.drain_since is None:
                    self.drain_since = time.monotonic()
                    n = llm.num_in_flight
                    print("tokenmill: shutting down: new requests get 503" + (
                        f"; the {n} in flight may finish for up to {timeout:g} s (a second Ctrl-C or SIGTERM ends "
                        f"them at once)" if n and timeout else ""), flush=True)
                if not llm.num_in_flight or time.monotonic() - self.drain_since >= timeout:
                    if llm.num_in_flight:
                        print(f"tokenmill: --shutdown-timeout ({timeout:g} s) is over: ending the "
                              f"{llm.num_in_flight} requests still in flight", flush=True)
                    self.cut()
            return await super().on_tick(counter)

    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    key = " (API key required)" if args.api_key else ""
    from tokenmill.executor.ops import plan_lines
    ops = engine.model.ops
    print(f"tokenmill: {ops.name} plan ({engine.config.dtype}, attention backend "
          f"{engine.runner.backend.name}):\n" + "\n".join(plan_lines(ops)), flush=True)
    each = f" in each of {args.data_parallel_size} replicas" if args.data_parallel_size > 1 else ""
    fills = "; its pages become resident as requests fill it" if engine.config.device.type == "cpu" else ""
    print(f"tokenmill: {engine.kv_cache_info().describe()}{each}{fills}", flush=True)
    if engine.runner.startup_line() is not None:
        print(f"tokenmill: {engine.runner.startup_line()}", flush=True)
    if engine.offload_line() is not None:
        print(f"tokenmill: {engine.offload_line()}{each}", flush=True)
    if engine.transfer is not None:
        print(f"tokenmill: {engine.transfer.config.describe()}", flush=True)
    print(f"tokenmill: serving {app.state.ctx.model_name} on {engine.config.device}\n"
          f"  OpenAI API:  {url}/v1{key}\n  playground:  {url}/\n  metrics:     {url}/metrics\n"
          f"  Ctrl-C or SIGTERM stops (requests in flight finish first, for up to {timeout:g} s; a second stops "
          f"at once).", flush=True)
    try:
        Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5)).run(sockets=[sock])
    finally:
        llm.shutdown(wait=True)
    return 0
