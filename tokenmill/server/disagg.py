"""`tokenmill router`: one OpenAI endpoint in front of prefill and decode instances (vLLM's disaggregated-prefill
proxy, SGLang's PD router).

Each completion or chat request goes first to a prefill instance, asked for one token and for the prompt's KV to be
sent to the decode instance chosen for it (kv_transfer_params, as vLLM's connectors take them). It then goes to that
decode instance, whose prefix cache finds the KV, and whose reply, streamed or not, is the client's. If the prefill
leg fails (the instance is down, or its transfer failed), the decode instance computes the prompt itself; the
fallback is counted and /health names the instance that is down until a probe finds it back and pairs it again.
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import os
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional

import httpx
from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry, Counter, generate_latest
from starlette.responses import JSONResponse, Response, StreamingResponse

from tokenmill.engine.router import Router

log = logging.getLogger("tokenmill.router")
PROBE_S = 1.0            # how often instances that are down are probed
ROUTED = ("/v1/completions", "/v1/chat/completions")
# fields a prefill leg drops: it makes one token, not streamed, for one choice
PREFILL_DROPS = ("stream_options", "max_completion_tokens", "min_tokens", "best_of")


@dataclass
class Instance:
    url: str
    role: str                                   # prefill | decode
    kv: Optional[tuple[str, int]] = None        # a decode instance's KV transfer address
    error: Optional[str] = None                 # why it is down (None: up)


def _error(status: int, message: str, code: str) -> JSONResponse:
    kind = {503: "service_unavailable", 401: "invalid_request_error"}.get(status, "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}}, status)


class DisaggRouter:
    """The instances, the pick of each request's pair (least loaded, as the data-parallel router does), the two
    legs, and the counts."""

    def __init__(self, prefill: list[str], decode: list[str], timeout: float = 600.0, api_key: Optional[str] = None):
        if not prefill or not decode:
            raise ValueError("tokenmill router needs at least one --prefill and one --decode instance URL")
        # the instances' key: sent on every call to them, and asked of the router's clients
        self.api_key = api_key
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.prefill = [Instance(u.rstrip("/"), "prefill") for u in prefill]
        self.decode = [Instance(u.rstrip("/"), "decode") for u in decode]
        self.client = self.new_client(timeout)
        self.pick_prefill = Router("least_loaded", len(self.prefill), 16, 0)
        self.pick_decode = Router("least_loaded", len(self.decode), 16, 0)
        self.registry = CollectorRegistry()
        self.requests = Counter("tokenmill:kv_transfer_requests", "Requests routed, by how the decode instance got "
                                "the prompt's KV: transferred, or computed there (fallback).", ["outcome"],
                                registry=self.registry)
        self.fallbacks = Counter("tokenmill:kv_transfer_fallbacks", "Requests whose prefill leg failed, by reason.",
                                 ["reason"], registry=self.registry)
        self.bytes = Counter("tokenmill:kv_transfer_bytes", "KV bytes the prefill instances sent.",
                             registry=self.registry)

    def new_client(self, timeout: float = 600.0) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0), headers=self.auth)

    def authorized(self, request: Request) -> bool:
        if not self.api_key:
            return True
        return hmac.compare_digest(request.headers.get("authorization", ""), f"Bearer {self.api_key}")

    # ---- the instances ----------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Ask each instance its role, then pair every prefill instance with every decode instance: a ValueError
        names an instance that cannot be reached, has another role, or whose pairing is refused."""
        for inst in self.decode + self.prefill:
            info = await self._info(inst)
            want = ("kv_consumer", "kv_both") if inst.role == "decode" else ("kv_producer", "kv_both")
            if info.get("kv_role") not in want:
                raise ValueError(f"{inst.url} is given as a {inst.role} instance but its KV role is "
                                 f"{info.get('kv_role')}; start it with --kv-role {inst.role}")
            if inst.role == "decode":
                inst.kv = (info["kv_ip"], info["kv_port"])
        for p in self.prefill:
            await self._pair(p)

    async def _info(self, inst: Instance) -> dict[str, Any]:
        try:
            r = await self.client.get(f"{inst.url}/v1/kv_transfer")
        except httpx.HTTPError as e:
            raise ValueError(f"the {inst.role} instance {inst.url} cannot be reached ({e!r})") from None
        if r.status_code == 401:
            raise ValueError(f"the {inst.role} instance {inst.url} wants an API key: give the router the instances' "
                             f"key with --api-key (or $TOKENMILL_API_KEY)")
        if r.status_code != 200:
            raise ValueError(f"the {inst.role} instance {inst.url} answers {r.status_code} to /v1/kv_transfer: is "
                             f"it a tokenmill server?")
        return r.json()

    async def _pair(self, p: Instance, decode: Optional[list[Instance]] = None) -> None:
        """Pair prefill instance p with the decode instances that are up (or those given)."""
        for d in decode if decode is not None else self.decode:
            if d.kv is None or d.error is not None:
                continue
            try:
                r = await self.client.post(f"{p.url}/v1/kv_transfer/connect", json={"host": d.kv[0], "port": d.kv[1]})
            except httpx.HTTPError as e:
                raise ConnectionError(f"the prefill instance {p.url} cannot be reached ({e!r})") from None
            if r.status_code == 400:
                raise ValueError(f"pairing {p.url} with {d.url}: {r.json()['error']['message']}")
            if r.status_code != 200:
                raise ConnectionError(f"pairing {p.url} with {d.url}: {r.status_code} {r.text[:300]}")

    def _down(self, inst: Instance, why: str) -> None:
        if inst.error is None:
            log.warning("%s instance %s is down: %s", inst.role, inst.url, why)
        inst.error = why

    async def probe(self) -> None:
        """Instances that are down, asked again every PROBE_S; a prefill instance back is paired again first."""
        while True:
            await asyncio.sleep(PROBE_S)
            for inst in self.prefill + self.decode:
                if inst.error is None:
                    continue
                try:
                    r = await self.client.get(f"{inst.url}/health", timeout=2.0)
                    if r.status_code != 200:
                        continue
                    if inst.role == "prefill":
                        await self._pair(inst)
                    else:       # restarted, perhaps on another KV port
                        info = await self._info(inst)
                        if info.get("kv_role") not in ("kv_consumer", "kv_both"):
                            raise ValueError(f"its KV role is now {info.get('kv_role')}")
                        inst.kv = (info["kv_ip"], info["kv_port"])
                except (httpx.HTTPError, ConnectionError, ValueError) as e:
                    inst.error = f"{inst.error.split(' (last probe')[0]} (last probe: {e})"
                    continue
                log.warning("%s instance %s is back", inst.role, inst.url)
                inst.error = None
                if inst.role == "decode":       # the prefill instances that are up pair with it again
                    for p in self.prefill:
                        if p.error is None:
                            try:
                                await self._pair(p, [inst])
                            except (httpx.HTTPError, ConnectionError, ValueError) as e:
                                self._down(p, str(e))

    def health(self) -> Response:
        down = [f"{i.role} instance {i.url} is down: {i.error}" for i in self.prefill + self.decode if i.error]
        if not down:
            return JSONResponse({"status": "ok"})
        return _error(503, "; ".join(down), "instance_down")

    # ---- a request's two legs ---------------------------------------------------------------------------------
    async def route(self, path: str, request: Request) -> Response:
        if not self.authorized(request):
            return _error(401, "a valid API key is required: send 'Authorization: Bearer KEY'", "invalid_api_key")
        raw = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() == "content-type"}
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if isinstance(body, dict) and "kv_transfer_params" in body:     # the router's to set, not a client's
            body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
            raw = json.dumps(body).encode()
        # a decode instance found unreachable is marked down, and the request tried once more on another that
        # is up (its prefill leg runs again, for that instance)
        for _ in range(2):
            alive = [d.error is None for d in self.decode]
            if not any(alive):
                break
            response = await self._route_to(path, raw, body, headers, alive)
            if response is not None:
                return response
        return _error(503, "; ".join(f"decode instance {d.url} is down: {d.error}" for d in self.decode
                                     if d.error is not None), "instance_down")

    async def _route_to(self, path: str, raw: bytes, body: Any, headers: dict, alive: list[bool]
                        ) -> Optional[Response]:
        """The request's two legs, on the least loaded decode instance that is up; None if it cannot be reached."""
        di = self.pick_decode.pick([], alive)
        dec = self.decode[di]
        released = False

        def release() -> None:          # once the decode leg ends: for a stream, when its last byte is relayed
            nonlocal released
            if not released:
                released = True
                self.pick_decode.load[di] -= 1
        try:
            if isinstance(body, dict):
                kvp = await self._prefill(path, body, headers, dec)
                if isinstance(kvp, Response):        # bad input: the client gets the prefill instance's answer
                    release()
                    return kvp
                body = {**body, "kv_transfer_params": kvp} if kvp else body
                raw = json.dumps(body).encode()
            stream = bool(isinstance(body, dict) and body.get("stream"))
            return await self._decode(path, raw, headers, dec, stream, release)
        except BaseException:
            release()
            raise

    async def _prefill(self, path: str, body: dict, headers: dict, dec: Instance) -> Any:
        """The prefill leg: the kv_transfer_params for the decode leg (None: fallback), or the error Response the
        prefill instance gave to bad input."""
        alive = [p.error is None for p in self.prefill]
        if not any(alive):
            return self._fallback("no prefill instance is up")
        pi = self.pick_prefill.pick([], alive)
        pre = self.prefill[pi]
        leg = {k: v for k, v in body.items() if k not in PREFILL_DROPS}
        leg.update(max_tokens=1, stream=False, n=1, kv_transfer_params={
            "do_remote_decode": True, "remote_host": dec.kv[0], "remote_port": dec.kv[1]})
        try:
            r = await self.client.post(f"{pre.url}{path}", json=leg, headers=headers)
        except httpx.HTTPError as e:
            self._down(pre, f"{e!r}")
            return self._fallback("prefill instance down")
        finally:
            self.pick_prefill.load[pi] -= 1
        if 400 <= r.status_code < 500:
            return Response(r.content, r.status_code, media_type="application/json")
        if r.status_code != 200:
            if r.status_code == 503:
                self._down(pre, f"503: {r.text[:200]}")
            return self._fallback(f"prefill instance answered {r.status_code}")
        kvp = r.json().get("kv_transfer_params") or {}
        if "error" in kvp or "blocks" not in kvp:
            return self._fallback("transfer failed")
        self.bytes.inc(kvp["bytes"])
        if not kvp["accepted"]:
            return self._fallback("no block accepted" if kvp["blocks"] else "prompt within one block")
        self.requests.labels("transferred").inc()
        return kvp

    def _fallback(self, reason: str) -> None:
        """The decode instance computes the prompt: counted, by reason."""
        self.requests.labels("fallback").inc()
        self.fallbacks.labels(reason).inc()
        return None

    async def _decode(self, path: str, raw: bytes, headers: dict, dec: Instance, stream: bool,
                      release: Callable[[], None]) -> Optional[Response]:
        try:
            req = self.client.build_request("POST", f"{dec.url}{path}", content=raw, headers=headers)
            r = await self.client.send(req, stream=True)
        except httpx.HTTPError as e:
            release()
            self._down(dec, f"cannot be reached ({e!r})")
            return None
        if not stream or r.status_code != 200:
            try:
                content = await r.aread()
            finally:
                await r.aclose()
                release()
            return Response(content, r.status_code, media_type=r.headers.get("content-type"))

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in r.aiter_raw():
                    yield chunk
            finally:
                await r.aclose()
                release()
        return StreamingResponse(relay(), r.status_code, media_type=r.headers.get("content-type"))

    async def forward_get(self, path: str, request: Request) -> Response:
        """A GET for the model list, from a decode instance that is up."""
        if not self.authorized(request):
            return _error(401, "a valid API key is required: send 'Authorization: Bearer KEY'", "invalid_api_key")
        for d in self.decode:
            if d.error is None:
                try:
                    r = await self.client.get(f"{d.url}{path}")
                    return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
                except httpx.HTTPError as e:
                    self._down(d, f"{e!r}")
        return _error(503, "no decode instance is up", "instance_down")


def build_router_app(router: DisaggRouter) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(router.probe())
        yield
        task.cancel()
        await router.client.aclose()

    app = FastAPI(title="tokenmill router", lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.route("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await router.route("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.forward_get("/v1/models", request)

    @app.get("/health")
    async def health() -> Response:
        return router.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.registry), media_type="text/plain; version=0.0.4; charset=utf-8")
    return app


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("router", help="one OpenAI endpoint over prefill and decode instances (serve "
                                             "--kv-role prefill|decode): each request is prefilled on one, its KV "
                                             "sent to the other, and decoded there")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill instances' URLs")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances' URLs")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--api-key", default=os.environ.get("TOKENMILL_API_KEY"),
                   help="the instances' API key: sent to them, and required of the router's clients (default: "
                        "$TOKENMILL_API_KEY, else none)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_router)


def cmd_router(args: argparse.Namespace) -> int:
    import uvicorn

    from tokenmill.server.cli import _bind
    router = DisaggRouter(args.prefill, args.decode, api_key=args.api_key)
    asyncio.run(router.start())
    router.client = router.new_client()     # the first one belongs to the closed loop
    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    pairs = ", ".join(f"{d.url} (KV at {d.kv[0]}:{d.kv[1]})" for d in router.decode)
    print(f"tokenmill: router on http://{host}:{port}/v1\n  prefill: {', '.join(p.url for p in router.prefill)}\n"
          f"  decode:  {pairs}", flush=True)
    uvicorn.Server(uvicorn.Config(build_router_app(router), log_level=args.log_level)).run(sockets=[sock])
    return 0
