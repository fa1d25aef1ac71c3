"""`tokenmill chat [MODEL]`: a conversation in the terminal, streamed token by token, with the history kept in the
model's chat template. On the engine in this process, or on a running server (--url). Ctrl-C stops a reply, not
the program; /clear, /system TEXT, /save FILE, /stats, /exit."""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

HELP = "/clear  /system TEXT  /save FILE  /stats  /exit   (Ctrl-C stops a reply, Ctrl-D leaves)"


@dataclass
class Reply:
    text: str = ""
    tokens: int = 0
    ttft: Optional[float] = None
    seconds: float = 0.0
    stopped: bool = False
    metrics: Any = None


@dataclass
class Conversation:
    system: Optional[str] = None
    turns: list[dict] = field(default_factory=list)

    def messages(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.turns


class LocalChat:
    """Replies from an engine in this process."""

    def __init__(self, args: argparse.Namespace):
        from tokenmill import LLM
        from tokenmill.cli import engine_kwargs
        self.llm = LLM(args.model, **engine_kwargs(args))
        self.args = args
        self.metrics: list = []
        self._ids = 0

    def stream(self, messages: list[dict], stop: Callable[[], bool]) -> Iterator[tuple[str, int]]:
        from tokenmill import SamplingParams
        from tokenmill.tokenizer import apply_chat_template
        tok = self.llm.get_tokenizer()
        ids = apply_chat_template(tok, messages)
        engine = self.llm.llm_engine
        self._ids += 1
        rid = f"chat-{self._ids}"
        engine.add_request(rid, {"prompt_token_ids": ids}, SamplingParams(
            temperature=self.args.temperature, top_p=self.args.top_p, max_tokens=self.args.max_tokens,
            seed=self.args.seed))
        sent = 0
        try:
            while engine.has_unfinished_requests() and not stop():
                for out in engine.step():
                    text = out.outputs[0].text
                    yield text[sent:], len(out.outputs[0].token_ids)
                    sent = len(text)
                    if out.finished:
                        self.metrics.append(out.metrics)
        finally:
            engine.abort_request(rid)       # a reply stopped by Ctrl-C gives its blocks back

    def stats(self) -> None:
        from tokenmill.cli import _phase_report
        _phase_report(self.metrics, self.llm)


class RemoteChat:
    """Replies from a running server's /v1/chat/completions, streamed."""

    def __init__(self, args: argparse.Namespace):
        import httpx
        self.url = args.url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=600)
        try:
            models = self.client.get("/v1/models")
        except httpx.HTTPError as e:
            raise ValueError(f"no server answers at {self.url} ({e}); start one with `tokenmill serve`") from None
        if models.status_code != 200:
            raise ValueError(f"{self.url}/v1/models answered {models.status_code}: {models.text[:200]}")
        self.model = models.json()["data"][0]["id"]
        self.args = args

    def stream(self, messages: list[dict], stop: Callable[[], bool]) -> Iterator[tuple[str, int]]:
        body = {"model": self.model, "messages": messages, "stream": True, "max_tokens": self.args.max_tokens,
                "temperature": self.args.temperature, "top_p": self.args.top_p, "seed": self.args.seed,
                "stream_options": {"include_usage": True}}
        tokens = 0          # content chunks until the usage chunk says how many tokens they held
        with self.client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise ValueError(f"the server answered {r.status_code}: {r.read().decode()[:300]}")
            for line in r.iter_lines():
                if stop():
                    return          # closing the stream aborts the request on the server
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                for c in chunk.get("choices") or []:
                    delta = c["delta"].get("content") or ""
                    if delta:
                        tokens += 1
                        yield delta, tokens
                if chunk.get("usage"):      # the true count: under load one chunk may carry several tokens
                    yield "", chunk["usage"]["completion_tokens"]

    def stats(self) -> None:
        print(f"(attached to {self.url}, model {self.model}: its /metrics has the server's figures)",
              file=sys.stderr)


def _reply(chat: Any, messages: list[dict]) -> Reply:
    """One reply, streamed to the terminal. Ctrl-C meanwhile only raises a flag that the stream reads between
    steps, so an engine step is never cut in the middle."""
    out, t0 = Reply(), time.perf_counter()

    def on_sigint(signum: int, frame: Any) -> None:
        out.stopped = True
    previous = signal.signal(signal.SIGINT, on_sigint)
    gen = chat.stream(messages, lambda: out.stopped)
    try:
        for delta, tokens in gen:
            if delta and out.ttft is None:
                out.ttft = time.perf_counter() - t0
            out.text += delta
            out.tokens = tokens
            sys.stdout.write(delta)
            sys.stdout.flush()
    finally:
        gen.close()
        signal.signal(signal.SIGINT, previous)
    out.seconds = time.perf_counter() - t0
    return out


def _rate(r: Reply) -> str:
    if r.ttft is None:
        return "no tokens"
    decode = r.seconds - r.ttft
    rate = f", {(r.tokens - 1) / decode:.1f} tok/s" if r.tokens > 1 and decode > 0 else ""
    return f"{r.tokens} tokens, TTFT {1000 * r.ttft:.0f} ms{rate}"


def run(args: argparse.Namespace) -> int:
    chat = RemoteChat(args) if args.url else LocalChat(args)
    conv = Conversation(system=args.system)
    print(f"tokenmill chat: {HELP}", flush=True)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print("\n(Ctrl-D or /exit leaves)", flush=True)
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit", "/bye"):
            return 0
        if text == "/clear":
            conv.turns.clear()
            print("(history cleared)", flush=True)
            continue
        if text.startswith("/system"):
            conv.system = text[len("/system"):].strip() or None
            conv.turns.clear()
            print(f"(system prompt {'set' if conv.system else 'removed'}; history cleared)", flush=True)
            continue
        if text.startswith("/save"):
            path = text[len("/save"):].strip()
            if not path:
                print("(give a file: /save FILE)", flush=True)
                continue
            with open(path, "w", encoding="utf-8") as f:
                json.dump({"messages": conv.messages()}, f, indent=1, ensure_ascii=False)
            print(f"(saved {len(conv.messages())} messages to {path})", flush=True)
            continue
        if text == "/stats":
            chat.stats()
            continue
        if text.startswith("/"):
            print(f"(unknown command; {HELP})", flush=True)
            continue
        conv.turns.append({"role": "user", "content": line})
        try:
            reply = _reply(chat, conv.messages())
        except ValueError as e:        # e.g. the conversation outgrew the context: say so, keep the session
            conv.turns.pop()
            print(f"\n(error: {e})", flush=True)
            continue
        conv.turns.append({"role": "assistant", "content": reply.text})
        print(f"\n[{'stopped: ' if reply.stopped else ''}{_rate(reply)}]", flush=True)


def register(sub: Any) -> None:
    from tokenmill.cli import add_engine_args
    p = sub.add_parser("chat", help="a conversation in the terminal, streamed (on this machine, or --url a server)")
    p.add_argument("model", nargs="?", default=None,
                   help="HF folder, .gguf or hub name (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--url", default=None, help="chat with a running `tokenmill serve` instead (its base URL)")
    p.add_argument("--api-key", default=None, help="the server's API key, with --url")
    p.add_argument("--system", default=None, help="a system prompt")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=None)
    add_engine_args(p)
    p.set_defaults(func=run)
