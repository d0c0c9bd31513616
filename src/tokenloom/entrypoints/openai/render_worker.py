"""A chat-template render worker: the child process that entrypoints/openai/chat_render.py starts.

`python -m tokenloom.entrypoints.openai.render_worker BUDGET PARENT_PID` imports transformers'
Jinja helpers, caps its own address space at what those imports took plus BUDGET bytes, says it is
ready, then renders jobs until its stdin closes. Frames both ways are a 4-byte big-endian length
and a msgpack body: a `ChatRender` and the most characters its output may have in, a `RenderReply`
out. A template that allocates past the cap gets a MemoryError (reported, then the worker exits:
an interpreter that ran out of memory is not trusted with the next job); one that runs too long is
killed by the parent; the kernel kills this process when the parent dies.
"""
from __future__ import annotations

import ctypes
import os
import resource
import signal
import struct
import sys

import msgspec

from tokenloom.engine.chat_template import ChatRender, render

_HEADER = struct.Struct(">I")


class RenderJob(msgspec.Struct, array_like=True, gc=False):
    job: ChatRender
    max_chars: int


class RenderReply(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """`text`, or `error` with its `kind`: "template" (the template failed), "size" (its output
    passed max_chars), "memory" (it passed the memory cap) or "ready" (the hello, no error)."""

    text: str = ""
    error: str = ""
    kind: str = ""


def _die_with(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _cap_memory(budget: int) -> None:
    # The cap counts from what the imports mapped, so that BUDGET is what a template may use
    # whatever this Python's libraries reserve.
    with open("/proc/self/status") as f:
        mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (mapped + budget, mapped + budget))


def _reply(out: int, reply: RenderReply) -> None:
    body = msgspec.msgpack.encode(reply)
    os.write(out, _HEADER.pack(len(body)))
    view = memoryview(body)
    while view:
        view = view[os.write(out, view):]


def _read_exactly(stream, n: int) -> bytes | None:
    data = stream.read(n)
    return data if data is not None and len(data) == n else None


def _serve(out: int) -> None:
    decoder = msgspec.msgpack.Decoder(RenderJob)
    stdin = sys.stdin.buffer
    while (head := _read_exactly(stdin, _HEADER.size)) is not None:
        body = _read_exactly(stdin, _HEADER.unpack(head)[0])
        if body is None:
            return
        try:
            request = decoder.decode(body)
            text = render(request.job)
            if len(text) > request.max_chars:
                reply = RenderReply(error=f"the rendered prompt is longer than {request.max_chars} characters",
                                    kind="size")
            else:
                reply = RenderReply(text=text)
        except MemoryError:
            _reply(out, RenderReply(error="the template used more memory than a render may", kind="memory"))
            os._exit(3)
        except Exception as e:  # noqa: BLE001 - any failure of a template is the template's
            reply = RenderReply(error=f"{type(e).__name__}: {e}", kind="template")
        _reply(out, reply)


def main() -> None:
    budget, parent = int(sys.argv[1]), int(sys.argv[2])
    _die_with(parent)
    # The replies get a descriptor of their own; anything a library prints goes to stderr.
    out = os.dup(1)
    os.dup2(2, 1)
    from transformers.utils import chat_template_utils  # noqa: F401 - imported before the cap

    _cap_memory(budget)
    _reply(out, RenderReply(kind="ready"))
    _serve(out)


if __name__ == "__main__":
    main()
