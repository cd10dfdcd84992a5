"""The built-in ``advice`` plugin: the advice ladder of a memory rejection.

Which knob helps depends on which ceiling binds, so the advice names the binding
ceiling, the figures behind it and the one setting (or command) that moves it:

- ``dynamic``: other programs hold the memory; close them (the static cap and what is
  reclaimable now are stated), or raise the memory tier (a larger share of what is free).
  Under tier ``custom`` the pinned ceiling is above what is free, so raising it cannot
  help either.
- ``custom``: raise the pinned ceiling, up to what the other ceilings allow.
- ``device``: raise the Metal wired limit (``sudo sysctl iogpu.wired_limit_mb=N``), raise
  the container's memory limit, or pick a smaller model for a CUDA card.
- ``static``: shorten the context, or move to a tier with a smaller reserve.
- no breakdown: a generic message that still names every knob.

When the binding ceiling is another rank's of a distributed group (the breakdown's
``rank``: rank 0 judged against the tightest rank), each rung names that rank's ceiling
and where to turn it (``serve --memory-ceiling ... on rank N``), and adds the rung that
only a group has: serve the model over more ranks. The figure to raise it to is that
rank's ceiling plus the shortfall where the refusal tells it (preflight, forward gate).

A request refused at admission (it waited for room that never came) is also told the
largest ``max_tokens`` that would have been admitted when the completion's reservation
is what did not fit. A request refused at preflight that would fit with the KV cache
quantized is told so, and which setting quantizes it (``--kv-bits``).

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


def _rank(b: CeilingBreakdown) -> str:
    """``"rank N's "`` where the binding ceilings are another rank's, else ``""``."""
    return f"rank {b.rank}'s " if b.rank is not None else ""


def _on(b: CeilingBreakdown) -> str:
    """``" on rank N"`` where the binding ceilings are another rank's, else ``""``."""
    return f" on rank {b.rank}" if b.rank is not None else ""


def _needed_there(rejection: Rejection, b: CeilingBreakdown) -> int | None:
    """What the binding ceiling would have to hold for the request to fit: the need
    itself (for admission, scaled up from its share of the hard limit to the whole), or,
    for another rank's ceiling (judged in this rank's terms), that ceiling
    plus the shortfall; ``None`` where the refusal's figures do not tell it (admission
    judged against another rank's budget)."""
    if b.rank is None:
        if rejection.stage == "admission" and rejection.limit_bytes and b.hard:
            # admission admits up to a share of the hard limit (memory.admit_watermark)
            return math.ceil(rejection.needed_bytes * b.hard / rejection.limit_bytes)
        return rejection.needed_bytes
    if rejection.stage == "admission" or rejection.limit_bytes is None or b.hard is None:
        return None
    return b.hard + rejection.needed_bytes - rejection.limit_bytes


def _dynamic(rejection: Rejection, b: CeilingBreakdown) -> str:
    reclaimable = format_size(b.reclaimable) if b.reclaimable is not None else "little"
    on, there = _on(b), " there" if b.rank is not None else ""
    if b.tier == "custom":
        pinned = format_size(b.custom) if b.custom else "unset"
        return (f"Other programs{on} are holding the memory: only {reclaimable} is reclaimable"
                f"{there} right now, so the dynamic ceiling ({format_size(b.dynamic)}) is below "
                f"{_rank(b) or 'your '}pinned custom ceiling ({pinned}). Raising the custom "
                f"ceiling cannot help until memory is freed: close other applications{on}, or "
                f"{_shorten(rejection)}.")
    static = format_size(b.static) if b.static is not None else "unknown"
    text = (f"Close other applications{on} to free memory: the static cap{there} under tier "
            f"{b.tier!r} is {static}, but only {reclaimable} is reclaimable right now, which "
            f"makes the dynamic ceiling {format_size(b.dynamic)}.")
    if b.tier in TIER_ORDER[:-1]:
        # The dynamic ceiling is the tier's share (dynamic_factor) of what is free.
        larger = " or ".join(repr(t) for t in TIER_ORDER[TIER_ORDER.index(b.tier) + 1:])
        text += (f" Or raise {_rank(b) or 'the '}memory tier to {larger} (memory.tier{_on(b)}), "
                 "whose dynamic ceiling allows a larger share of the free memory.")
    return text + f" Or {_shorten(rejection)}."


def _custom(rejection: Rejection, b: CeilingBreakdown) -> str:
    needed = _needed_there(rejection, b)
    others = [v for name, v in b.ceilings().items() if name != "custom"]
    allowed = min(others) if others else None
    machine = f"rank {b.rank}'s" if b.rank is not None else "this machine's"
    owner = f"Rank {b.rank}'s" if b.rank is not None else "Your"
    text = (f"{owner} pinned ceiling ({format_size(b.custom)}, memory.custom_ceiling) binds: "
            "raise it")
    if needed is None:
        text += f" (a larger serve --memory-ceiling{_on(b)})"
    else:
        target = _suggested_bytes(needed)
        text += (f" to at least {format_size(target)} (serve --memory-ceiling "
                 f"{_size_flag(target)}{_on(b)})")
    if allowed is not None and needed is not None and allowed < needed:
        return (text + f", although {machine} other ceilings allow only "
                f"{format_size(allowed)}, so {_shorten(rejection)} as well.")
    if allowed is not None:
        text += f"; {machine} other ceilings allow up to {format_size(allowed)}"
    return text + f". Or {_shorten(rejection)}."


def _device(rejection: Rejection, b: CeilingBreakdown) -> str:
    needed = _needed_there(rejection, b)
    target = _suggested_bytes(needed) if needed is not None else None
    device = format_size(b.device)
    owner = f"Rank {b.rank}'s" if b.rank is not None else "The"
    if b.device_kind == "metal":
        if target is None:
            return (f"{owner} Metal GPU wired-memory limit ({device}) binds: raise it with "
                    f"`sudo sysctl iogpu.wired_limit_mb=N`{_on(b)} (lasts until reboot), or "
                    f"{_shorten(rejection)}.")
        mac = f"rank {b.rank}'s Mac" if b.rank is not None else "this Mac"
        if b.total_ram is not None and target > b.total_ram - MACOS_KEEP_FREE:
            return (f"{owner} Metal GPU memory limit ({device}) binds, and this request needs "
                    f"about {format_size(needed)}, more than {mac} can give the GPU while keeping "
                    f"{format_size(MACOS_KEEP_FREE)} for macOS: pick a smaller model or "
                    f"{_shorten(rejection)}.")
        return (f"{owner} Metal GPU wired-memory limit ({device}) binds: raise it with "
                f"`sudo sysctl iogpu.wired_limit_mb={math.ceil(target / MIB)}`{_on(b)} (lasts "
                f"until reboot), or {_shorten(rejection)}.")
    if b.device_kind == "cgroup":
        at_least = f" to at least {format_size(target)}" if target is not None else ""
        example = f"={math.ceil(target / MIB)}m" if target is not None else ""
        return (f"{owner} container's memory limit ({device}, cgroup memory.max) binds: raise "
                f"it{at_least} (e.g. docker run --memory{example}, or the pod's "
                f"resources.limits.memory), or {_shorten(rejection)}.")
    if b.device_kind == "cuda":
        return (f"{owner} CUDA device's memory ({device}) binds and cannot be raised: pick a "
                f"smaller or more quantized model, or {_shorten(rejection)}.")
    return (f"{owner} device memory limit ({device}) binds: pick a smaller model or "
            f"{_shorten(rejection)}.")


def _static(rejection: Rejection, b: CeilingBreakdown) -> str:
    machine = f"rank {b.rank}'s" if b.rank is not None else "this machine's"
    total = format_size(b.total_ram) if b.total_ram is not None else f"{machine} RAM"
    owner = f"Rank {b.rank}'s" if b.rank is not None else "The"
    base = (f"{owner} static ceiling ({format_size(b.static)}: {total} total less the reserve "
            f"of tier {b.tier!r}) binds: {_shorten(rejection)} (reduce the context)")
    if b.tier in TIER_ORDER[:-1]:
        larger = TIER_ORDER[TIER_ORDER.index(b.tier) + 1:]
        tiers = " or ".join(repr(t) for t in larger)
        return (base + f", or raise {_rank(b) or 'the '}tier to {tiers} (memory.tier{_on(b)}), "
                "which keeps a smaller reserve.")
    if b.tier == "aggressive":
        return (base + ", or pin a ceiling yourself with memory.tier = \"custom\" and "
                f"--memory-ceiling{_on(b)}.")
    needed = _needed_there(rejection, b)
    return base + (f"; the request needs about {format_size(needed)}." if needed is not None
                   else ".")


def _more_ranks(b: CeilingBreakdown) -> str:
    return (f"Or serve the model over more than {b.ranks} ranks, where its split allows: each "
            "rank then holds a smaller share of the weights and of the KV cache.")


def _max_tokens(rejection: Rejection) -> str | None:
    if rejection.fitting_max_tokens is None:
        return None
    return (f"This request reserves {format_size(rejection.decode_bytes)} for the KV of its "
            f"max_tokens={rejection.max_tokens} completion; with max_tokens="
            f"{rejection.fitting_max_tokens} (or less) it would have run now.")


def _kv_bits(rejection: Rejection) -> str | None:
    bits = rejection.fitting_kv_bits
    if bits is None:
        return None
    model = rejection.model_id or "<id>"
    return (f"With the KV cache quantized to {bits} bits this request would fit: serve with "
            f"--kv-bits {bits} (engine.kv_bits = {bits}, or kv_bits = {bits} under "
            f"[models.{model}]; perplexity on the default model "
            f"{'-0.02 %' if bits == 8 else '+5.6 %'} of the unquantized cache's, BENCHMARKS.md).")


@hookimpl
def on_rejection(rejection: Rejection) -> str | None:
    if not isinstance(rejection, Rejection):
        return None
    ladder = _ladder(rejection)
    knob = _max_tokens(rejection) or _unpin(rejection) or _kv_bits(rejection)
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
    text = {"dynamic": _dynamic, "custom": _custom, "device": _device, "static": _static}[binding](
        rejection, breakdown)
    return text if breakdown.rank is None else f"{text} {_more_ranks(breakdown)}"
