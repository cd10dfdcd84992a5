"""The declared surface for engine plugins: what an engine may import from omlx-core for
scheduling, caching, memory and models.

An engine plugin (the built-in ``batched``, ``dflash``, ``vlm`` and ``distributed``
ones, and a third party's) imports from omlx-core only:

- ``omlx_core.engine``: the engine contract (``GuardedEngine``, ``GenerationRequest``...);
- ``omlx_core.host``: the ``EngineHost`` it is built with;
- ``omlx_core.hookspecs``: ``hookimpl``; ``omlx_core.settings``: ``Setting``;
- **this module**, for everything below (never its submodules, never another plugin:
  ``tests/test_plugin_structure.py`` fails on either).

What is here:

- **continuous batching**: :class:`BatchedEngine` (one model, served by a
  :class:`Scheduler`; subclass it to serve more than text, as ``vlm`` does, or to run it
  on several processes, as ``distributed`` does), the scheduler and its extension
  points (:class:`ChunkInputs`, :class:`CacheKey`, :class:`DraftVerify`,
  :class:`StepSync`), a request's :class:`SequenceState` and :class:`Phase`;
- **speculation**: the :class:`Drafter` protocol, prompt lookup (:class:`NgramDrafter`),
  acceptance (:func:`accept_greedy`, :func:`accept_sampled`, :class:`KeyStream`);
- **sampling**: :func:`check_sampling`, :func:`make_sampler`,
  :func:`make_logits_processors`;
- **caching**: :class:`PrefixCache`, :class:`CachedBlock`, :class:`BlockStore` (a lower
  tier), the KV formats (:class:`KVFormat`, :func:`make_request_cache`);
- **memory**: the forward gate's protocol and its messages (:class:`ForwardGate`,
  :class:`MemoryReceiver`, :class:`PrefillStep`, :class:`PrefillChunk`...), the guard's
  types (:class:`LimitSnapshot`, :class:`PeakEstimate`, :class:`RequestRejected`...);
- **models**: loading (:func:`load_model`, :func:`model_classes`...), :class:`ModelSpec`
  and :class:`ModelError`.
"""

from omlx_core.grammar import GrammarError, GrammarSpec
from omlx_core.memory.ceilings import TierPolicy
from omlx_core.memory.gate import (
    UNLIMITED_TOKENS,
    CacheRestore,
    DecodePlan,
    DecodeRow,
    DecodeStep,
    ForwardGate,
    MemoryReceiver,
    PrefillChunk,
    PrefillStep,
    Refusals,
)
from omlx_core.memory.types import (
    CAUSES,
    CEILING_NAMES,
    STAGES,
    CeilingBreakdown,
    LimitSnapshot,
    PeakEstimate,
    PeakQuery,
    Rejection,
    RequestRejected,
)
from omlx_core.models.loader import (
    activation_dtype_bytes,
    hf_tokenizer,
    install_cpu_routes,
    load_model,
    model_classes,
    settle_random_state,
)
from omlx_core.models.registry import ModelError, ModelSpec
from omlx_core.scheduling.acceptance import KeyStream, accept_greedy, accept_sampled, target_log_probs
from omlx_core.scheduling.batch_state import Phase, SequenceState, new_sequence
from omlx_core.scheduling.block_hashes import salted_keys
from omlx_core.scheduling.drafters import Draft, DraftFootprint, Drafter, DraftState, NgramDrafter
from omlx_core.scheduling.engine import BatchedEngine, EngineSettings, create_prefix_cache
from omlx_core.scheduling.extensions import (
    CacheKey,
    ChunkInputs,
    DraftVerify,
    LocalSteps,
    NoDrafts,
    StepSync,
    TokenInputs,
    token_key,
)
from omlx_core.scheduling.kv_cache import KV_BITS, KVFormat, make_request_cache
from omlx_core.scheduling.prefix_cache import BlockStore, CachedBlock, PrefixCache
from omlx_core.scheduling.sampling import check_sampling, make_logits_processors, make_sampler
from omlx_core.scheduling.scheduler import Scheduler
from omlx_core.scheduling.speculation import PromptLookupDrafts

__all__ = [
    # continuous batching
    "BatchedEngine", "EngineSettings", "Phase", "Scheduler", "SequenceState", "new_sequence",
    "CacheKey", "ChunkInputs", "DraftVerify", "LocalSteps", "NoDrafts", "StepSync", "TokenInputs",
    "token_key",
    # speculation
    "Draft", "DraftFootprint", "DraftState", "Drafter", "KeyStream", "NgramDrafter",
    "PromptLookupDrafts", "accept_greedy", "accept_sampled", "target_log_probs",
    # sampling
    "check_sampling", "make_logits_processors", "make_sampler",
    # caching
    "BlockStore", "CachedBlock", "KVFormat", "KV_BITS", "PrefixCache", "create_prefix_cache",
    "make_request_cache",
    # memory
    "CAUSES", "CEILING_NAMES", "STAGES", "CacheRestore", "CeilingBreakdown", "DecodePlan", "DecodeRow", "DecodeStep",
    "ForwardGate", "LimitSnapshot", "MemoryReceiver", "PeakEstimate", "PeakQuery", "PrefillChunk",
    "PrefillStep", "Refusals", "Rejection", "RequestRejected", "TierPolicy", "UNLIMITED_TOKENS",
    # models
    "ModelError", "ModelSpec", "activation_dtype_bytes", "hf_tokenizer", "install_cpu_routes", "salted_keys",
    "load_model", "model_classes", "settle_random_state",
    # what a request asks for, as a rank's step message carries it
    "GrammarError", "GrammarSpec",
]
