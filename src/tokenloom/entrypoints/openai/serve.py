"""`tokenloom serve`'s process: the listening socket bound before the engine starts, the engine,
uvicorn around the app (api_server.build_app), the start-up lines, and the two watchers that end
it cleanly -- the drain of requests in flight on SIGTERM/SIGINT (`DRAIN_S`, then a 503 each) and
the watchdog that stops the server (exit status 1, for a supervisor) when the engine core dies.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

from fastapi import FastAPI

from tokenloom.engine.async_llm import DEFAULT_TOKENIZER_POOL_LIMIT_S, AsyncLLM
from tokenloom.engine.core_client import DEFAULT_HEARTBEAT_TIMEOUT_S
from tokenloom.entrypoints.chat_templates import resolve_chat_template
from tokenloom.entrypoints.openai.api_server import DRAIN_S, build_app
from tokenloom.entrypoints.openai.chat_render import ChatTemplateRenderer, RenderLimits
from tokenloom.entrypoints.openai.serving_engine import DEFAULT_MAX_PROMPTS_PER_REQUEST
from tokenloom.entrypoints.openai.serving_lora import check_lora_modules
from tokenloom.entrypoints.openai.serving_responses import DEFAULT_STORE_SIZE
from tokenloom.model.generation_config import default_sampling_params as generation_defaults
from tokenloom.model.generation_config import defaults_source

logger = logging.getLogger("tokenloom.serve")


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, but a stop by SIGINT or SIGTERM ends `serve()` normally: uvicorn
        re-raises the signal once it has shut down, so the process died of it (a KeyboardInterrupt
        traceback for Ctrl-C). A requested stop is a clean exit, status 0, as vLLM's server makes it."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

        on_started: Callable[[], None] | None = None

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            # Still inside the loop's turn that opened the socket: no request is answered before
            # the start-up lines are out, so whoever sees the server answer can read them.
            if self.started and self.on_started is not None:
                self.on_started()

    return Server


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's content when it names a file (vLLM's rule), a shipped template
    by name (entrypoints/chat_templates), else the template itself."""
    return resolve_chat_template(value, "--chat-template")


def render_limits(args: argparse.Namespace) -> RenderLimits:
    """The chat-template render limits the serve flags set (a ValueError names a bad one)."""
    return RenderLimits(timeout_s=getattr(args, "chat_template_timeout", 10.0),
                        memory_bytes=getattr(args, "chat_template_max_memory", 256 * 1024**2),
                        num_workers=getattr(args, "chat_template_workers", 2))


def _ssl_options(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn's TLS settings from vLLM's --ssl-* flags (empty: plain HTTP), checked by loading
    them here, before the model: a wrong path or a key that does not match is one line naming
    the flag, not a server that fails after start-up."""
    import ssl

    keyfile, certfile = getattr(args, "ssl_keyfile", None), getattr(args, "ssl_certfile", None)
    ca_certs, cert_reqs = getattr(args, "ssl_ca_certs", None), getattr(args, "ssl_cert_reqs", 0)
    if keyfile is None and certfile is None:
        if ca_certs is not None or cert_reqs:
            raise ValueError("--ssl-ca-certs and --ssl-cert-reqs apply to HTTPS: give --ssl-keyfile and --ssl-certfile.")
        return {}
    if keyfile is None or certfile is None:
        raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile.")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"--ssl-certfile {certfile!r} / --ssl-keyfile {keyfile!r} cannot be loaded: {e}") from None
    if ca_certs is not None:
        try:
            context.load_verify_locations(ca_certs)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"--ssl-ca-certs {ca_certs!r} cannot be loaded: {e}") from None
    return {"ssl_keyfile": keyfile, "ssl_certfile": certfile, "ssl_ca_certs": ca_certs, "ssl_cert_reqs": cert_reqs}


def _listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the engine starts (as vLLM binds it): a port in use fails
    at once, not after the model has loaded."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} cannot be resolved: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def _startup_lines(engine: AsyncLLM, url: str, sampling_defaults: dict[str, Any]) -> list[str]:
    info = engine.engine_core.info
    kv_tokens = info.kv_cache_capacity_tokens or info.num_kv_blocks * info.block_size
    lines = [
        f"tokenloom serve: listening on {url}",
        f"tokenloom serve: model {engine.model_name}"
        + (f" ({engine.config.model})" if engine.config.model not in (None, engine.model_name) else "")
        + f" | dtype {info.dtype} | "
        f"quantization {info.quantization or 'none'} | max_model_len {info.max_model_len} | KV cache "
        f"{info.num_kv_blocks} blocks x {info.block_size} tokens ({kv_tokens} tokens of one request), {info.kv_cache_dtype}",
    ]
    if info.cpu:
        lines.append(f"tokenloom serve: CPU {info.cpu}")
    if info.cuda_graphs:
        lines.append(f"tokenloom serve: CUDA graphs of {info.cuda_graphs} (--enforce-eager: none)")
    spec = engine.config.speculative_config
    if spec is not None:
        lines.append(f"tokenloom serve: speculative decoding {spec.method}, up to {spec.num_speculative_tokens} draft "
                     f"tokens from n-grams of {spec.prompt_lookup_min}-{spec.prompt_lookup_max} tokens"
                     + (f", none while {spec.disable_by_batch_size}+ requests run" if spec.disable_by_batch_size else ""))
    if sampling_defaults:  # a request's sampling differs from tokenloom's defaults: say why, as vLLM warns
        source = defaults_source(engine.config.generation_config, engine.config.override_generation_config)
        lines.append(f"tokenloom serve: default sampling parameters {sampling_defaults} from {source} "
                     "(--generation-config vllm: tokenloom's own)")
    return lines


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from tokenloom.entrypoints.engine_args import engine_config_from_args

    _check_serve_args(args)
    chat_template = read_chat_template(getattr(args, "chat_template", None))
    limits = render_limits(args)
    ssl_options = _ssl_options(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENLOOM_LOG_LEVEL", args.log_level.upper())  # the engine core's, inherited
    # Resolved before the socket: a missing repo, a gated one or a max_model_len over the model's is
    # one line.
    config = engine_config_from_args(args)
    # The model as given (a hub id, not the cache folder it is downloaded to) names it.
    names = args.served_model_name or [config.model_name]
    # Before the socket and the engine: a model's unusable generation_config.json is one line.
    sampling_defaults = generation_defaults(config.model, config.generation_config, config.override_generation_config)
    check_lora_modules(dict(getattr(args, "lora_modules", None) or []), config.enable_lora, config.max_lora_rank, names)
    sock = _listen_socket(args.host, args.port)
    try:
        engine = AsyncLLM(config, model_name=names[0], metrics_prefix=getattr(args, "metrics_prefix", "tokenloom"))
    except BaseException:
        sock.close()
        raise
    engine.set_health_limits(getattr(args, "health_heartbeat_timeout", DEFAULT_HEARTBEAT_TIMEOUT_S),
                             getattr(args, "health_tokenizer_pool_limit", DEFAULT_TOKENIZER_POOL_LIMIT_S))
    app = _build_app(args, engine, names, chat_template, sampling_defaults, limits)
    server = _server_class()(
        uvicorn.Config(app, host=args.host, port=args.port, log_level=getattr(args, "uvicorn_log_level", None) or args.log_level,
                       access_log=not getattr(args, "disable_uvicorn_access_log", False),
                       # Past the drain, which ends what still runs with a 503: room to send those ends.
                       timeout_graceful_shutdown=DRAIN_S + 5, **ssl_options)
    )

    engine_died = asyncio.Event()
    keep_alive = getattr(args, "keep_alive_on_engine_death", False)

    def say_what_runs() -> None:
        host, port = sock.getsockname()[:2]
        url = f"{'https' if ssl_options else 'http'}://{f'[{host}]' if ':' in host else host}:{port}"
        print("\n".join(_startup_lines(engine, url, sampling_defaults)), flush=True)

    server.on_started = say_what_runs

    async def serve() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        watchdog = asyncio.create_task(_watch_engine(server, engine, exit_on_death=not keep_alive, died=engine_died))
        drain = asyncio.create_task(_end_requests_when_stopping(server, engine, DRAIN_S, app.state.renderer))
        await task
        watchdog.cancel()
        drain.cancel()
        await app.state.renderer.aclose()  # the drain may have killed workers after the lifespan ended

    try:
        asyncio.run(serve())
    finally:
        sock.close()
        engine.shutdown()  # a second call is harmless; the core also dies with this process
    # Exit status 1 tells a supervisor to restart: only when the engine's death stopped the server
    # (kept up by hand, a later stop is a clean exit; so is a stop by SIGINT or SIGTERM).
    return 0 if server.started and not (engine_died.is_set() and not keep_alive) else 1


def _check_serve_args(args: argparse.Namespace) -> None:
    """The serve flags' own rules, checked before anything starts (`model_tag` becomes --model)."""
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}.")
        args.model = args.model_tag
    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        raise ValueError(f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}.")
    if getattr(args, "responses_store_size", 0) < 0:
        raise ValueError(f"--responses-store-size must be >= 0, got {args.responses_store_size}.")
    if getattr(args, "max_log_len", 0) < 0:
        raise ValueError(f"--max-log-len must be >= 0, got {args.max_log_len}.")
    if not getattr(args, "health_heartbeat_timeout", 1.0) > 0:
        raise ValueError(f"--health-heartbeat-timeout must be > 0, got {args.health_heartbeat_timeout}.")
    if not getattr(args, "health_tokenizer_pool_limit", 1.0) > 0:
        raise ValueError(f"--health-tokenizer-pool-limit must be > 0, got {args.health_tokenizer_pool_limit}.")
    if args.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes must be >= 1, got {args.max_request_body_bytes}.")
    if getattr(args, "max_prompts_per_request", 1) < 1:
        raise ValueError(f"--max-prompts-per-request must be >= 1, got {args.max_prompts_per_request}.")
    if not getattr(args, "multiprocess", True):
        raise ValueError("tokenloom serve runs the engine core in a child process; --inprocess is not supported.")


def _build_app(args: argparse.Namespace, engine: AsyncLLM, names: list[str], chat_template: str | None,
               sampling_defaults: dict[str, Any], limits: RenderLimits) -> FastAPI:
    """The app for these serve flags (read with getattr where a Namespace built elsewhere may lack one)."""
    return build_app(
        engine,
        served_model_names=names,
        api_key=args.api_key,
        max_waiting_requests=args.max_waiting_requests,
        shutdown_engine_on_exit=True,
        max_request_body_bytes=args.max_request_body_bytes,
        max_prompts_per_request=getattr(args, "max_prompts_per_request", DEFAULT_MAX_PROMPTS_PER_REQUEST),
        tool_call_parser=getattr(args, "tool_call_parser", "hermes"),
        reasoning_parser=getattr(args, "reasoning_parser", None),
        chat_template=chat_template,
        response_role=getattr(args, "response_role", "assistant"),
        allowed_origins=getattr(args, "allowed_origins", None),
        allowed_methods=getattr(args, "allowed_methods", None),
        allowed_headers=getattr(args, "allowed_headers", None),
        allow_credentials=getattr(args, "allow_credentials", False),
        root_path=getattr(args, "root_path", ""),
        default_sampling_params=sampling_defaults,
        enable_prompt_tokens_details=getattr(args, "enable_prompt_tokens_details", False),
        return_tokens_as_token_ids=getattr(args, "return_tokens_as_token_ids", False),
        log_requests=getattr(args, "log_requests", False),
        responses_store_size=getattr(args, "responses_store_size", DEFAULT_STORE_SIZE),
        lora_modules=dict(getattr(args, "lora_modules", None) or []),
        max_log_len=getattr(args, "max_log_len", 200),
        force_include_usage=getattr(args, "enable_force_include_usage", False),
        enable_docs=not getattr(args, "disable_fastapi_docs", False),
        trust_request_chat_template=getattr(args, "trust_request_chat_template", False),
        render_limits=limits,
    )


async def _end_requests_when_stopping(server: Any, engine: AsyncLLM, drain_s: float,
                                      renderer: ChatTemplateRenderer) -> None:
    """Once the server is stopping, requests in flight get `drain_s` to finish; what still runs
    then is ended by shutting the engine down (and the chat-template renders by killing their
    workers), so each stream ends with its error event and [DONE], and each plain request with a
    503 (`server_shutting_down`), before uvicorn gives up on their connections (which cuts a body
    off mid-way)."""
    while not server.should_exit:
        await asyncio.sleep(0.1)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + drain_s

    def in_flight() -> int:  # in the core, or still being parsed, rendered or tokenized
        return engine.get_num_unfinished_requests() + engine.num_off_loop_jobs + renderer.num_busy

    while in_flight() > 0 and loop.time() < deadline:
        await asyncio.sleep(0.1)
    if renderer.num_busy:
        logger.warning("shutting down: ending %d chat-template render(s) still running after %.0f s",
                       renderer.num_busy, drain_s)
    renderer.close()
    running = engine.get_num_unfinished_requests() + engine.num_off_loop_jobs
    if running:
        logger.warning("shutting down: ending %d request(s) still running after %.0f s", running, drain_s)
        engine.shutdown()


ENGINE_WATCHDOG_INTERVAL_S = 0.5


async def _watch_engine(server: Any, engine: AsyncLLM, *, exit_on_death: bool, died: asyncio.Event | None = None) -> bool:
    """vLLM's policy: an engine core that died is not restarted in place, so the server shuts down
    (gracefully: responses in flight still deliver their error) and exits with status 1 for its
    supervisor to restart it. Until then everything answers 503. With --keep-alive-on-engine-death
    (`exit_on_death=False`) it stays up answering 503 on every route. Either way the dead core is
    reaped (no zombie) and its sockets released. Polling also catches a core that dies while no
    request is in flight. True when the engine died (and `died` is set) while the server ran: a
    core that ends because the server is stopping (a Ctrl-C reaches both) is not a death."""
    while not server.should_exit:
        if engine.is_dead:
            if died is not None:
                died.set()
            reason = str(engine.dead_error or "the engine core process exited").splitlines()[0]
            if exit_on_death:
                logger.error("engine core is dead (%s): shutting the server down", reason)
                server.should_exit = True
            else:
                logger.error(
                    "engine core is dead (%s): answering 503 until restarted (--keep-alive-on-engine-death)", reason
                )
            await engine.reap_dead_core()
            return True
        await asyncio.sleep(ENGINE_WATCHDOG_INTERVAL_S)
    return False

