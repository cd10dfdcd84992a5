"""The built-in ``advice`` plugin: the advice ladder of a memory rejection.

Which knob helps depends on which ceiling binds, so the advice names the binding
ceiling, the figures behind it and the one setting (or command) that moves it:

- ``dynamic``: other programs hold the memory; close them (the static cap and what is
  reclaimable now are stated). Under tier ``custom`` the pinned ceiling is above what is
  free, so raising it cannot help either.
- ``custom``: raise the pinned ceiling, up to what the other ceilings allow.
- ``device``: raise the Metal wired limit (``sudo sysctl iogpu.wired_limit_mb=N``), raise
  the container's memory limit, or pick a smaller model for a CUDA card.
- ``static``: shorten the context, or move to a tier with a smaller reserve.
- no breakdown: a generic message that still names every knob.

A request refused at admission (it waited for room that never came) is also told the
largest ``max_tokens`` that would have been admitted when the completion's reservation
is what did not fit.

A request refused at the ``load`` stage (its model cannot be loaded: it can never fit,
or busy and pinned models hold the room) is told to use a smaller or more quantized
variant of the model instead of a shorter prompt, and which pinned models it could
unpin to make room (``POST /admin/models/<id>/unpin``).

A third-party plugin adds advice with its own ``on_rejection``, or replaces this
plugin's with ``@hookimpl(wrapper=True)`` returning its own list.
"""

from __future__ import annotations

import math

from omlx_core.hookspecs import hookimpl
from omlx_core.memory.types import CeilingBreakdown, Rejection
from omlx_core.settings import format_size

MIB = 1024**2
GIB = 1024**3
# Headroom on top of the request's need when advising a new limit.
SUGGESTION_HEADROOM = 1.10
# What macOS keeps for itself when the GPU wired limit is raised by hand.
MACOS_KEEP_FREE = 4 * GIB
TIER_ORDER = ("safe", "balanced", "aggressive")


def _suggested_bytes(needed: int) -> int:
    """``needed`` plus headroom, rounded up to 256 MiB."""
    step = 256 * MIB
    return math.ceil(needed * SUGGESTION_HEADROOM / step) * step


def _size_flag(size: int) -> str:
    """A size as a command-line value: whole GiB where it is one, MiB otherwise."""
    return f"{size // GIB}GiB" if size % GIB == 0 else f"{math.ceil(size / MIB)}MiB"


def _shorten(rejection: Rejection) -> str:
    if rejection.stage == "load":
        return ("use a smaller or more quantized variant of the model (e.g. `omlx-core models "
                "convert-gguf --dtype keep` keeps a GGUF's quantization; float16 halves float32)")
    if rejection.stage in ("forward", "admission"):
        return "send a shorter prompt, or retry when fewer requests are running"
    return "shorten the prompt"


def _generic(rejection: Rejection) -> str:
    return (f"This request needs about {format_size(rejection.needed_bytes)} of memory and the "
            "server could not tell which ceiling limits it. "
            f"{_shorten(rejection).capitalize()}, close other applications, or give the server "
            "more memory: a tier with a smaller reserve (memory.tier), a pinned ceiling "
            "(memory.tier = \"custom\" with --memory-ceiling), or a larger container limit. "
            "`omlx-core doctor` shows the machine's memory.")


def _dynamic(rejection: Rejection, b: CeilingBreakdown) -> str:
    reclaimable = format_size(b.reclaimable) if b.reclaimable is not None else "little"
    if b.tier == "custom":
        pinned = format_size(b.custom) if b.custom else "unset"
        return (f"Other programs are holding the memory: only {reclaimable} is reclaimable right "
                f"now, so the dynamic ceiling ({format_size(b.dynamic)}) is below your pinned "
                f"custom ceiling ({pinned}). Raising the custom ceiling cannot help until memory "
                f"is freed: close other applications, or {_shorten(rejection)}.")
    static = format_size(b.static) if b.static is not None else "unknown"
    return (f"Close other applications to free memory: the static cap under tier {b.tier!r} is "
            f"{static}, but only {reclaimable} is reclaimable right now, which makes the dynamic "
            f"ceiling {format_size(b.dynamic)}. Or {_shorten(rejection)}.")


def _custom(rejection: Rejection, b: CeilingBreakdown) -> str:
    target = _suggested_bytes(rejection.needed_bytes)
    others = [v for name, v in b.ceilings().items() if name != "custom"]
    allowed = min(others) if others else None
    text = (f"Your pinned ceiling ({format_size(b.custom)}, memory.custom_ceiling) binds: raise it "
            f"to at least {format_size(target)} (serve --memory-ceiling {_size_flag(target)})")
    if allowed is not None and allowed < rejection.needed_bytes:
        return (text + f", although this machine's other ceilings allow only "
                f"{format_size(allowed)}, so {_shorten(rejection)} as well.")
    if allowed is not None:
        text += f"; this machine's other ceilings allow up to {format_size(allowed)}"
    return text + f". Or {_shorten(rejection)}."


def _device(rejection: Rejection, b: CeilingBreakdown) -> str:
    needed = rejection.needed_bytes
    target = _suggested_bytes(needed)
    device = format_size(b.device)
    if b.device_kind == "metal":
        if b.total_ram is not None and target > b.total_ram - MACOS_KEEP_FREE:
            return (f"The Metal GPU memory limit ({device}) binds, and this request needs about "
                    f"{format_size(needed)}, more than this Mac can give the GPU while keeping "
                    f"{format_size(MACOS_KEEP_FREE)} for macOS: pick a smaller model or "
                    f"{_shorten(rejection)}.")
        return (f"The Metal GPU wired-memory limit ({device}) binds: raise it with "
                f"`sudo sysctl iogpu.wired_limit_mb={math.ceil(target / MIB)}` (lasts until "
                f"reboot), or {_shorten(rejection)}.")
    if b.device_kind == "cgroup":
        return (f"The container's memory limit ({device}, cgroup memory.max) binds: raise it to "
                f"at least {format_size(target)} (e.g. docker run --memory={math.ceil(target / MIB)}m, "
                f"or the pod's resources.limits.memory), or {_shorten(rejection)}.")
    if b.device_kind == "cuda":
        return (f"The CUDA device's memory ({device}) binds and cannot be raised: pick a smaller "
                f"or more quantized model, or {_shorten(rejection)}.")
    return (f"The device memory limit ({device}) binds: pick a smaller model or "
            f"{_shorten(rejection)}.")


def _static(rejection: Rejection, b: CeilingBreakdown) -> str:
    total = format_size(b.total_ram) if b.total_ram is not None else "this machine's RAM"
    base = (f"The static ceiling ({format_size(b.static)}: {total} total less the reserve of "
            f"tier {b.tier!r}) binds: {_shorten(rejection)} (reduce the context)")
    if b.tier in TIER_ORDER[:-1]:
        larger = TIER_ORDER[TIER_ORDER.index(b.tier) + 1:]
        return (base + f", or raise the tier to {' or '.join(repr(t) for t in larger)} "
                "(memory.tier), which keeps a smaller reserve.")
    if b.tier == "aggressive":
        return (base + ", or pin a ceiling yourself with memory.tier = \"custom\" and "
                "--memory-ceiling.")
    return base + f"; the request needs about {format_size(rejection.needed_bytes)}."


def _max_tokens(rejection: Rejection) -> str | None:
    if rejection.fitting_max_tokens is None:
        return None
    return (f"This request reserves {format_size(rejection.decode_bytes)} for the KV of its "
            f"max_tokens={rejection.max_tokens} completion; with max_tokens="
            f"{rejection.fitting_max_tokens} (or less) it would have run now.")


@hookimpl
def on_rejection(rejection: Rejection) -> str | None:
    if not isinstance(rejection, Rejection):
        return None
    ladder = _ladder(rejection)
    knob = _max_tokens(rejection) or _unpin(rejection)
    return ladder if knob is None else f"{knob} {ladder}"


def _unpin(rejection: Rejection) -> str | None:
    if rejection.stage != "load" or not rejection.pinned_models:
        return None
    names = ", ".join(repr(name) for name in rejection.pinned_models)
    first = rejection.pinned_models[0]
    return (f"Pinned models hold memory that is never given up for another model: {names}. "
            f"Unpin one (POST /admin/models/{first}/unpin, or pinned = false in its "
            "[models.<id>]) so that it can be unloaded when idle.")


def _ladder(rejection: Rejection) -> str:
    breakdown = rejection.breakdown
    binding = breakdown.binding if breakdown is not None else None
    if breakdown is None or binding is None:
        return _generic(rejection)
    return {"dynamic": _dynamic, "custom": _custom, "device": _device, "static": _static}[binding](
        rejection, breakdown)
