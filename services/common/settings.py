"""Typed, validated settings shared by the service settings classes:
each service reads flags and `SPECD_<SERVICE>_*` environment variables through one
pydantic-settings class; `SPECD_REDIS_URL` and `SPECD_CACHE_DIR` are shared by all."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from specd.types import MAX_BRANCHES


class ServiceSettings(BaseSettings):
    host: str = Field("127.0.0.1", description="interface to listen on (0.0.0.0 for all)")
    port: int = Field(0, ge=0, le=65535, description="port to listen on (0: any free port)")
    log_level: str = Field("info", pattern="^(debug|info|warning|error)$")
    drain_grace_s: float = Field(600.0, ge=0, le=86400,
                                 description="on SIGTERM: health answers NOT_SERVING (503 'draining'), new "
                                             "requests are refused, and requests in flight get this long to "
                                             "finish before the process exits (a second signal: at once)")


class SecurityFields(BaseSettings):
    """TLS, mTLS and a shared token on the process's gRPC links, server side and client side alike
    (services.common.security)."""

    tls_cert: Path | None = Field(None, description="PEM certificate of this process: its server certificate "
                                                    "and, as a client, its client certificate (mTLS)")
    tls_key: Path | None = Field(None, description="PEM private key of tls_cert")
    tls_ca: Path | None = Field(None, description="PEM CA bundle that verifies peers: the servers this process "
                                                  "calls and, with tls_client_auth, its clients")
    tls_client_auth: bool = Field(False, description="as a server, require client certificates signed by "
                                                     "tls_ca (mTLS)")
    tls_server_name: str | None = Field(None, description="name checked in the server certificate instead of "
                                                          "the address's host (e.g. when dialing an IP)")
    auth_token: SecretStr | None = Field(None, validation_alias=AliasChoices("auth_token", "SPECD_AUTH_TOKEN"),
                                         description="shared bearer token: sent on every call, and required "
                                                     "of callers (all but the health check)")
    insecure: bool = Field(False, description="plaintext gRPC chosen on purpose (needed to listen on or dial "
                                              "a non-loopback address without TLS or a token)")


class GrpcServiceSettings(ServiceSettings, SecurityFields):
    metrics_port: int = Field(9100, ge=0, le=65535,
                              description="port of the Prometheus /metrics endpoint (0: any free port)")
    reflection: bool = Field(False, description="serve gRPC server reflection (lists the services and their "
                                                "messages)")


class ModelFields(BaseSettings):
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N | shard (auto: CUDA when present; "
                                               "shard: layers spread over every visible GPU)")
    dtype: str = Field("auto", description="auto | float32 | bfloat16 | float16")
    threads: int = Field(0, ge=0, le=1024, description="torch CPU threads (0: torch's default)")
    linear_kernels: str = Field("auto", pattern="^(auto|rows|onednn|torch)$",
                                description="auto | rows | onednn | torch (auto: for a float32 model on the "
                                            "CPU, specd's few-row product where it builds, else oneDNN "
                                            "with weights packed at load time)")
    forward: str = Field("auto", pattern="^(auto|lean|hf)$",
                         description="auto | lean | hf (auto: specd's lean forward for a float32 "
                                     "model of a family it serves on the CPU, transformers' logits)")
    cache_dir: Path | None = Field(None, validation_alias=AliasChoices("cache_dir", "SPECD_CACHE_DIR"),
                                   description="where the embedded model's dequantized weights are kept")


class ModelSettings(GrpcServiceSettings, ModelFields):
    pass


class EarlyExitFields(BaseSettings):
    target_model: str = Field("embedded", description="the target model: early-exit drafts with its layers")
    draft_layers: int = Field(4, ge=1, le=256, description="target layers used by early-exit")
    draft_adapter: Path | None = Field(None, description="trained early-exit adapter (safetensors; default: "
                                                         "the bundled one for the embedded target at 4 "
                                                         "layers; 'none': untrained)")


def redis_field(description: str = "Redis for shared adaptive policy state (unset: in-process memory)"):
    return Field(None, validation_alias=AliasChoices("redis_url", "SPECD_REDIS_URL"), description=description)


class DraftSettings(ModelSettings, EarlyExitFields):
    model_config = SettingsConfigDict(env_prefix="SPECD_DRAFT_")

    port: int = Field(50061, ge=0, le=65535)
    metrics_port: int = Field(9101, ge=0, le=65535, description="port of the Prometheus /metrics endpoint")
    drafter: str = Field("ngram", pattern="^(hf|early-exit|ngram|retrieval|feature|hybrid)$",
                         description="ngram (no model), retrieval (ngram plus a datastore of target answers), "
                                     "early-exit (the target's first layers), hf, feature (an EAGLE-style "
                                     "head on the target's hidden states; draft_adapter: the head), or hybrid "
                                     "(early-exit's chain with retrieval's proposals beside it as a draft tree)")
    branches: int | None = Field(None, ge=0, le=MAX_BRANCHES,
                                 description="side branches verified beside each window's chain as a draft tree "
                                             "(ngram, retrieval, hybrid); a request's own value wins; default: the "
                                             "drafter's (hybrid 2, the others 0: chains)")
    datastore: Path | None = Field(None, description="retrieval's datastore (default: the one bundled for "
                                                     "the embedded target)")
    draft_model: str | None = Field(None, description="transformers directory for --drafter hf")
    specdecpp_head: Path | None = Field(None, description="SpecDec++ head (default: the bundled one)")
    dvi: bool = Field(False, description="learn online (DVI, early-exit only): log judged drafts to Redis and "
                                         "hot-swap the adapters `specd serve trainer` publishes; needs redis_url")
    dvi_poll_s: float = Field(1.0, gt=0, le=3600, description="seconds between checks for a new DVI adapter")
    redis_url: str | None = redis_field("Redis holding the DVI replay stream and adapters (with dvi)")
    kv_slots: int = Field(16, ge=0, le=4096,
                          description="sessions a model drafter (hf, early-exit) keeps in a preallocated KV "
                                      "pool, whose draft steps then run in shared forwards; a session beyond "
                                      "them is refused and its request goes on with the target alone. 0: no "
                                      "pool, each session drafts alone")
    kv_max_len: int = Field(4608, ge=2, le=1 << 20, description="positions of one KV slot (as the target's)")
    kv_memory_fraction: float = Field(0.8, gt=0.0, le=1.0,
                                      description="share of the device's free memory (on the CPU, of "
                                                  "available RAM) the draft's KV pool may take (as the "
                                                  "target's)")
    max_batch_size: int = Field(16, ge=1, le=256, description="most sessions' draft steps in one forward pass")
    load_draft_caps: str = Field("", description="let load cap every policy's window, as SESSIONS:CAP pairs: "
                                                 "'8:4,16:0' allows at most 4 drafts a window while 8 or more "
                                                 "sessions share the target's forwards and none from 16 (as "
                                                 "vLLM's speculation cut-off by batch size); empty: no cap by "
                                                 "load (cost-aware prices the load itself)")

    @field_validator("load_draft_caps")
    @classmethod
    def _load_caps(cls, value: str) -> str:
        parse_load_caps(value)
        return value


class TrainerSettings(ServiceSettings, ModelFields, EarlyExitFields):
    """the DVI trainer: learns the early-exit drafter's adapter online from the replay stream"""
    model_config = SettingsConfigDict(env_prefix="SPECD_TRAINER_")

    port: int = Field(9104, ge=0, le=65535, description="port of the Prometheus /metrics endpoint")
    redis_url: str | None = redis_field("Redis holding the DVI replay stream and adapters (required)")
    rank: int = Field(16, ge=1, le=1024, description="LoRA rank")
    lr: float = Field(2e-3, gt=0, le=1.0, description="AdamW learning rate")
    batch_size: int = Field(64, ge=1, le=65536, description="records per update")
    kl_steps: int = Field(200, ge=0, description="updates of pure distillation before the RL terms join")
    updates_per_record: float = Field(1.0, gt=0, le=64, description="updates made per record read")
    publish_every: int = Field(50, ge=1, description="publish the adapter every this many updates")
    checkpoint: Path | None = Field(None, description="file to keep the trainer's state in and resume from")


class TargetSettings(ModelSettings):
    model_config = SettingsConfigDict(env_prefix="SPECD_TARGET_")

    port: int = Field(50062, ge=0, le=65535)
    metrics_port: int = Field(9102, ge=0, le=65535, description="port of the Prometheus /metrics endpoint")
    model: str = Field("embedded", description="'embedded' (SmolLM2-135M-Instruct) or a transformers directory")
    max_batch_size: int = Field(16, ge=1, le=256, description="most sessions verified in one forward pass")
    batch_gather: float = Field(0.5, ge=0.0, le=4.0,
                                description="before a forward, wait for the sessions the last forward answered "
                                            "(their next windows are one round trip away), at most this "
                                            "fraction of the last forward's duration (0: never wait)")
    latency_budget: float = Field(0.0, ge=0.0, le=1000.0,
                                  description="keep the time per generated token within this multiple of a "
                                              "one-token forward alone: a new session is refused at once "
                                              "(RESOURCE_EXHAUSTED, the gateway's 503 with Retry-After) while "
                                              "the open sessions' time per token is over it, or when more "
                                              "sessions than the start-up cost surface allows are open. 0: only "
                                              "kv_slots limits sessions")
    kv_slots: int = Field(16, ge=0, le=4096,
                          description="sessions the preallocated KV pool holds, at most (kv_memory_fraction "
                                      "may hold fewer); a session beyond them is refused at once "
                                      "(RESOURCE_EXHAUSTED). 0: no pool, each session grows its own cache "
                                      "with no cap on their number or memory")
    kv_memory_fraction: float = Field(0.8, gt=0.0, le=1.0,
                                      description="share of the device's free memory (after the weights; "
                                                  "on the CPU, of available RAM) the KV pool may take: "
                                                  "it holds fewer than kv_slots sessions where they would "
                                                  "not fit, and start-up fails where not one fits")
    kv_fair_share_reserve: float = Field(0.125, ge=0.0, le=1.0,
                                         description="share of the KV pool's slots kept for tenants (the "
                                                     "gateway's API keys) holding less than a fair share, the "
                                                     "slots over the tenants with open sessions plus one: once "
                                                     "only these are free, a tenant holding its share is "
                                                     "refused (RESOURCE_EXHAUSTED). 0: first come, first served")
    kv_max_len: int = Field(4608, ge=2, le=1 << 20,
                            description="positions (prompt and answer) of one KV slot, at most the model's "
                                        "context")
    prefill_chunk: int = Field(256, ge=0, le=1 << 20,
                               description="prompt tokens prefilled per forward, so that a long prompt does "
                                           "not stall other sessions' verifications (0: whole prompts)")
    cuda_graphs: str = Field("auto", pattern="^(auto|on|off|compiled)$",
                             description="capture the pool's forwards in CUDA graphs at start-up (auto: on a "
                                         "CUDA device with a KV pool, not with tensor_parallel, of layers "
                                         "compiled by torch.compile, or plain layers where compiling fails; "
                                         "on: plain layers; compiled: compiled layers or an error)")
    cpu_compile: str = Field("auto", pattern="^(auto|on|off)$",
                             description="compile the pool's forwards ahead of time on the CPU (AOTInductor; "
                                         "auto: a float32 model of 16M+ weights with a KV pool, not with "
                                         "tensor_parallel; the first start compiles, later ones load)")
    tensor_parallel: int = Field(1, ge=1, le=64,
                                 description="shard every layer's heads and MLP columns over this many processes "
                                             "(one GPU each, or CPU processes over gloo), started by the command "
                                             "itself with torchrun; rank 0 serves. Needs a model specd's runtime "
                                             "serves whose heads split evenly, and a KV pool")
    drafter: str = Field("none", pattern="^(none|ngram|retrieval)$",
                         description="a lookup drafter the target drafts with itself, for coordinators that "
                                     "ask it to: each round's window is drafted between the target's forwards, "
                                     "with no round trip to a draft service (none: every draft comes from a "
                                     "draft service)")
    datastore: Path | None = Field(None, description="retrieval's datastore (default: the one bundled for the "
                                                     "target)")
    virtual_device: Path | None = Field(None, description="benchmarks only: every forward of the KV pool takes the "
                                                          "time this device profile gives for its shape "
                                                          "(bench-load's results.json, its target_costs), the "
                                                          "model still computing on this machine "
                                                          "(specd/runtime/virtual.py)")
    virtual_replay: Path | None = Field(None, description="benchmarks only, with virtual_device: each forward's "
                                                          "logits follow these recorded answers where its context "
                                                          "is one of theirs (scripts/draft_cost.py --answers; "
                                                          "specd/runtime/virtual.py)")
    max_window_tokens: int = Field(64, ge=1, le=4096,
                                   description="draft tokens (chain and draft-tree side nodes) one verification "
                                               "may bring; a larger window is refused (INVALID_ARGUMENT naming "
                                               "tokens): each costs a row of logits and, sampled, a dense q")
    idle_timeout_s: float = Field(60.0, ge=0, le=86400,
                                  description="a session that sends no message this long is ended "
                                              "(DEADLINE_EXCEEDED) and its KV slot freed (0: never)")


class CoordinatorSettings(GrpcServiceSettings):
    model_config = SettingsConfigDict(env_prefix="SPECD_COORDINATOR_")

    port: int = Field(50063, ge=0, le=65535)
    metrics_port: int = Field(9103, ge=0, le=65535, description="port of the Prometheus /metrics endpoint")
    target_address: str = Field("127.0.0.1:50062", description="host:port of the target service (or a list, "
                                                              "as the gateway's coordinator address)")
    draft_address: str = Field("127.0.0.1:50061", description="host:port of the draft service ('' = none; "
                                                             "or a list)")
    overlap: bool = Field(True, description="PEARL: draft the next window while the target verifies "
                                            "(not for a lookup drafter, ngram or retrieval, unless a request "
                                            "asks: it has no drafting time to hide)")
    default_policy: str = Field("cost-aware", description="stopping policy when a request names none")
    request_timeout_s: float = Field(600.0, gt=0, le=86400, description="deadline of one request")
    draft_stall_s: float = Field(10.0, gt=0, le=3600,
                                 description="waiting this long on the draft alone falls back to the target")
    startup_timeout_s: float = Field(600.0, gt=0, le=86400,
                                     description="at start-up, retry reaching the target (with backoff, health "
                                                 "NOT_SERVING meanwhile) this long, then exit non-zero")
    redis_url: str | None = redis_field()
    max_draft_tokens: int = Field(64, ge=1, le=256,
                                  description="largest speculative.max_draft_tokens (or policy parameter "
                                              "max_draft_tokens) a request may ask; above it the request is "
                                              "refused (INVALID_ARGUMENT, the gateway's 400). At most the "
                                              "target's max_window_tokens")


class GatewaySettings(ServiceSettings, SecurityFields):
    model_config = SettingsConfigDict(env_prefix="SPECD_GATEWAY_")

    port: int = Field(8000, ge=0, le=65535)
    coordinator_address: str = Field("", description="host:port of a coordinator service, or of several "
                                                  "(dns:///NAME:PORT, ipv4:HOST:PORT,HOST:PORT: requests "
                                                  "take turns); '' = in-process")
    target_address: str = Field("127.0.0.1:50062", description="target service, for the in-process coordinator")
    draft_address: str = Field("127.0.0.1:50061", description="draft service, for the in-process coordinator")
    overlap: bool = Field(True, description="PEARL overlap in the in-process coordinator (not for a "
                                            "lookup drafter unless a request asks)")
    default_policy: str = Field("cost-aware", description="stopping policy when a request names none")
    max_tokens_limit: int = Field(4096, ge=1, le=1 << 20, description="largest max_tokens a request may ask")
    max_body_bytes: int = Field(4 << 20, ge=0, le=1 << 30,
                                description="a larger request body is refused with 413 before it is read "
                                            "(0: no limit)")
    max_concurrent_requests: int = Field(64, ge=0, le=1 << 20,
                                         description="generations in flight beyond which a request is refused "
                                                     "at once with 503 and Retry-After (0: no limit)")
    max_concurrent_per_key: int = Field(32, ge=0, le=1 << 20,
                                        description="generations one API key without a concurrency limit of "
                                                    "its own may have in flight on this gateway; one more "
                                                    "gets 429 and Retry-After (0: no cap)")
    fair_share_reserve: float = Field(0.125, ge=0, le=1,
                                      description="fraction of max_concurrent_requests kept for API keys "
                                                  "holding less than their fair share (the slots over the "
                                                  "keys in flight); a key at its share gets 429 there")
    max_concurrent_parses: int = Field(4, ge=1, le=1024,
                                       description="large request bodies parsed and validated at once, off the "
                                                   "event loop; one more is refused with 503 and Retry-After")
    stream_send_timeout_s: float = Field(15.0, gt=0, le=86400,
                                         description="a streaming client that takes no byte for this long (a "
                                                     "send waits, or bytes wait in the connection's buffers) is "
                                                     "cut off: its generation is cancelled, its KV slot freed")
    limit_concurrency: int = Field(1024, ge=0, le=1 << 20,
                                   description="open connections (or requests) beyond which uvicorn answers 503 "
                                               "(0: no limit)")
    request_read_timeout_s: float = Field(30.0, gt=0, le=3600,
                                          description="a connection whose request (headers and body) has not all "
                                                      "arrived this long after it opened, or after its last "
                                                      "response, is closed (slowloris)")
    keep_alive_timeout_s: int = Field(5, ge=1, le=3600,
                                      description="an idle keep-alive connection is closed after this long")
    api_keys: str = Field("", description="comma-separated static API keys, unlimited, named key-1, "
                                          "key-2, ... (kept for old deploys; prefer `specd keys create`)")
    auth: str = Field("required", pattern="^(required|open)$",
                      description="required: /v1 needs a known API key (from keys_file, else the Redis at "
                                  "redis_url, or api_keys) and the gateway refuses to start without one; "
                                  "open: no key is checked")
    keys_file: Path | None = Field(None, description="JSON file of API keys made by `specd keys create "
                                                     "--keys-file` (unset: the keys in Redis at redis_url)")
    max_task_tags_per_key: int = Field(50, ge=0, le=100_000,
                                       description="distinct speculative.task_tag values one API key may use "
                                                   "(besides default); past it a request uses the key's "
                                                   "default tag (0: always the default)")
    request_timeout_s: float = Field(600.0, gt=0, le=86400)
    startup_timeout_s: float = Field(600.0, gt=0, le=86400,
                                     description="at start-up, retry reaching the coordinator (or the target) "
                                                 "with backoff, /health 503 meanwhile, this long, then exit "
                                                 "non-zero")
    redis_url: str | None = redis_field()


def parse_load_caps(text: str) -> tuple[tuple[int, int], ...]:
    """'8:4,16:0' -> ((8, 4), (16, 0)): at 8 or more sessions in a forward at most 4 drafts a
    window, at 16 or more none. Sessions must ascend and caps must not grow."""
    pairs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        sessions, sep, cap = part.partition(":")
        if not sep or not sessions.strip().isdigit() or not cap.strip().isdigit():
            raise ValueError(f"expected SESSIONS:CAP pairs such as '8:4,16:0', got {part!r}")
        pairs.append((int(sessions), int(cap)))
    for (s0, c0), (s1, c1) in pairwise(pairs):
        if s1 <= s0 or c1 > c0:
            raise ValueError(f"sessions must ascend and caps must not grow: {s0}:{c0} then {s1}:{c1}")
    if pairs and pairs[0][0] < 1:
        raise ValueError("sessions start at 1")
    return tuple(pairs)
