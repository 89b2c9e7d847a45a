"""The KV geometry handshake: each side states how its KV blocks are laid out,
and prefill refuses a pull it cannot honour before it writes a byte.

What a side states (``Geometry``): tokens per block (``--block-size``) and
the attention kernel's block size, the KV dtype (``--kv-cache-dtype``,
``auto`` resolved through ``--dtype``), its TP rank and size and PP size,
the draft (``--speculative-config``: method and model, or none), and per
registered region the layer, its layout (MLA latent or GQA K/V), its bytes
per kernel block, KV heads per rank and dtype. Each server logs its own at
start-up; decode sends its own in every pull (``wire.XferMetadata.pd_geometry``,
a field upstream's decoder ignores), prefill its own in the first answer to
each decode worker (``wire.XferResponse.pd_geometry``).

Why upstream's checks are not enough (vLLM 0.32, mooncake_connector.py):
upstream compares region byte lengths only for a GQA model at equal TP
(``_validate_asymmetric_region_lengths``; an MLA model skips it), converts
decode's logical block ids with prefill's own kernel ratio
(``_logical_to_kernel_block_ids`` on ``remote_block_ids_by_group``), never
compares tokens per block or dtypes, and reports a missing draft as a
layer alignment error that names no flag. Observed unchecked (negative
controls: test_geometry.py on real registered workers,
test_geometry_servers.py on real servers): a decode without the draft
fails with "producer registered layer has no matching consumer
occurrence" (HTTP 500); a bfloat16 prefill sends half blocks into a
float32 decode without an error (wrong KV); float32 into bfloat16 fails
on upstream's assertion; 16- against 32-token blocks send half the
prompt into the wrong decode blocks without an error (wrong KV). Wrong KV
becomes wrong tokens unless the KV checksum (pd_mooncake.checksum) is on.

Refused (prefill answers the pull with upstream's ERROR status and the
reason, logs it once per decode worker; decode's upstream pull fails its
requests with that reason, so vLLM's ``kv_load_failure_policy`` fails or
recomputes them): different tokens per block, kernel block sizes, KV dtypes,
draft presence or identity, region layouts or bytes per block at equal TP,
layer sets at equal PP, TP sizes of which neither divides the other.
Honoured and logged: a different TP with MLA (the latent cache is whole on
every rank: a decode rank pulls it from one prefill rank), a different TP
for GQA heads where upstream splits them (a model without MLA regions, the
same bytes per head), a different PP (upstream aligns regions by layer
name), a different number of speculative tokens (the KV per token is the
same).

How this relates to vLLM 0.33's ``layout_id`` (MooncakeXferMetadata.layout_id,
MooncakeXferResponseStatus.LAYOUT_MISS): 0.33's decode mints a random id per
``register_kv_caches`` and, once a prefill worker has echoed it, sends pulls
without the layout (addresses, byte lengths, layer names); prefill keeps the
aligned regions per (peer, layout_id) and answers LAYOUT_MISS when it lost
them. That saves re-sending and re-aligning the layout on every pull; it
compares nothing new (no tokens per block, dtype or draft). The geometry is
orthogonal: a small statement of meaning, compared once per decode worker and
geometry (prefill caches the verdict by the stated geometry), carried beside
either form of upstream's pull. On 0.33 a pull without the layout still
carries ``pd_geometry``.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import PurePath
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
    mooncake_connector as upstream,
)

from pd_mooncake import faults, tp_pairs, wire
from pd_mooncake.metric_names import GQA_LAYOUT, MLA_LAYOUT

logger = logging.getLogger("vllm.pd_mooncake")

# The flags a refusal names, in one place.
FLAG_BLOCK_SIZE = "--block-size"
FLAG_KERNEL = "the attention backend (VLLM_ATTENTION_BACKEND / --attention-config)"
FLAG_KV_DTYPE = "--kv-cache-dtype (its 'auto' follows --dtype)"
FLAG_DRAFT = "--speculative-config"
FLAG_TP = "--tensor-parallel-size"
FLAG_MODEL = "--model (both roles must serve the same model)"

# Prefill: refused transfer ids remembered until prefill's request is ready
# (then its blocks are freed); a bound, not a size anyone should reach.
REFUSED_KEPT = 4096
# vLLM's aliases of one KV dtype (vllm/config/cache.py: fp8 = fp8_e4m3).
_DTYPE_ALIASES = {"fp8": "fp8_e4m3", "half": "float16", "float": "float32"}


@dataclass(frozen=True)
class Region:
    """One registered KV region, as the transfer addresses it."""

    layer: str
    layout: str  # MLA_LAYOUT or GQA_LAYOUT
    bytes_per_block: int  # per kernel block (upstream's kv_block_len)
    heads: int = 0  # KV heads per rank (0: not known)
    dtype: str = ""


@dataclass(frozen=True)
class Geometry:
    block_size: int  # tokens per (logical) block: --block-size
    kernel_block_size: int
    kv_dtype: str
    tp_rank: int
    tp_size: int
    pp_size: int
    draft: str | None  # "method:model", None without a draft
    num_speculative_tokens: int
    regions: tuple[Region, ...] = field(default_factory=tuple)

    def wire(self) -> dict[str, Any]:
        out = asdict(self)
        out["regions"] = [list(asdict(r).values()) for r in self.regions]
        return out

    @classmethod
    def from_wire(cls, value: Mapping[str, Any] | None) -> Geometry | None:
        """The stated geometry, or None where none (or an unreadable one) was
        stated: a peer without the plugin, or from before it stated one."""
        if not value:
            return None
        try:
            regions = tuple(Region(*r) for r in value.get("regions") or ())
            return cls(
                block_size=int(value["block_size"]),
                kernel_block_size=int(value["kernel_block_size"]),
                kv_dtype=str(value["kv_dtype"]),
                tp_rank=int(value["tp_rank"]),
                tp_size=int(value["tp_size"]),
                pp_size=int(value["pp_size"]),
                draft=value.get("draft"),
                num_speculative_tokens=int(value.get("num_speculative_tokens", 0)),
                regions=regions,
            )
        except (KeyError, TypeError, ValueError):
            return None

    def describe(self) -> str:
        """One log line's worth: scalars, then the regions grouped by what
        they hold (a 61-layer model has two or three kinds of region)."""
        kinds: dict[tuple[str, int, int, str], list[str]] = {}
        for r in self.regions:
            kinds.setdefault(
                (r.layout, r.bytes_per_block, r.heads, r.dtype), []
            ).append(r.layer)
        regions = ", ".join(
            f"{len(layers)} x {layout} {nbytes} B/block"
            + (f" {heads} heads" if heads else "")
            + (f" {dtype}" if dtype else "")
            + f" ({_span(layers)})"
            for (layout, nbytes, heads, dtype), layers in kinds.items()
        )
        return (
            f"block_size={self.block_size} kernel_block_size={self.kernel_block_size} "
            f"kv_dtype={self.kv_dtype} tp={self.tp_rank}/{self.tp_size} "
            f"pp_size={self.pp_size} draft={self.draft or 'none'}"
            + (f" k={self.num_speculative_tokens}" if self.draft else "")
            + f" regions=[{regions}]"
        )


def _span(layers: Sequence[str]) -> str:
    return layers[0] if len(layers) == 1 else f"{layers[0]} .. {layers[-1]}"


def kv_dtype_name(cache_dtype: str, model_dtype: Any) -> str:
    """The KV dtype a server stores: ``--kv-cache-dtype``, or with ``auto``
    the model's dtype (``--dtype``), in vLLM's spelling."""
    name = cache_dtype if cache_dtype and cache_dtype != "auto" else str(model_dtype)
    name = name.removeprefix("torch.")
    return _DTYPE_ALIASES.get(name, name)


def draft_name(speculative_config: Any) -> tuple[str | None, int]:
    """ "method:model" of the draft (the model by its directory name: the
    same model can sit under different paths on two hosts), and k."""
    if speculative_config is None:
        return None, 0
    method = getattr(speculative_config, "method", None) or "draft"
    draft_model = getattr(speculative_config, "draft_model_config", None)
    path = getattr(draft_model, "model", None) or getattr(
        speculative_config, "model", None
    )
    name = PurePath(str(path).rstrip("/")).name if path else "?"
    k = int(getattr(speculative_config, "num_speculative_tokens", 0) or 0)
    return f"{method}:{name}", k


# -- the comparison -------------------------------------------------------------
@dataclass(frozen=True)
class Difference:
    what: str  # e.g. "block size"
    prefill: Any
    decode: Any
    # Empty when the transfer honours the difference; then ``how`` says how.
    flag: str = ""
    how: str = ""

    @property
    def honoured(self) -> bool:
        return not self.flag

    def __str__(self) -> str:
        head = f"{self.what}: prefill {self.prefill}, decode {self.decode}"
        if self.honoured:
            return f"{head} ({self.how})"
        return f"{head}; set {self.flag} the same on both roles"


@dataclass(frozen=True)
class Verdict:
    differences: tuple[Difference, ...] = ()

    @property
    def refused(self) -> tuple[Difference, ...]:
        return tuple(d for d in self.differences if not d.honoured)

    @property
    def honoured(self) -> tuple[Difference, ...]:
        return tuple(d for d in self.differences if d.honoured)

    @property
    def refusal(self) -> str | None:
        """The error decode's requests fail with (None: the pull proceeds)."""
        if not self.refused:
            return None
        return "KV geometry differs: " + "; ".join(str(d) for d in self.refused)


def _divides(a: int, b: int) -> bool:
    return tp_pairs.refusal(a, b, mla=False) is None


def compare(prefill: Geometry, decode: Geometry) -> Verdict:
    """Every difference between the two sides' geometry, each refused (with
    the flag to change) or honoured (with how)."""
    out: list[Difference] = []
    p, d = prefill, decode
    scalar_refused = False
    if p.block_size != d.block_size:
        # Upstream pairs prefill's and decode's block lists position by
        # position and converts decode's ids with prefill's kernel ratio.
        out.append(
            Difference("block size", p.block_size, d.block_size, FLAG_BLOCK_SIZE)
        )
        scalar_refused = True
    elif p.kernel_block_size != d.kernel_block_size:
        out.append(
            Difference(
                "kernel block size",
                p.kernel_block_size,
                d.kernel_block_size,
                FLAG_KERNEL,
            )
        )
        scalar_refused = True
    if p.kv_dtype != d.kv_dtype:
        out.append(Difference("KV dtype", p.kv_dtype, d.kv_dtype, FLAG_KV_DTYPE))
        scalar_refused = True
    if p.draft != d.draft:
        # Without the draft's KV decode's draft proposes from garbage (and
        # upstream fails the pull on the KV group count anyway); a different
        # draft's KV means nothing to decode's.
        out.append(
            Difference("draft", p.draft or "none", d.draft or "none", FLAG_DRAFT)
        )
        scalar_refused = True
    elif p.draft and p.num_speculative_tokens != d.num_speculative_tokens:
        out.append(
            Difference(
                "speculative tokens",
                p.num_speculative_tokens,
                d.num_speculative_tokens,
                how="the KV per token is the same; decode proposes its own",
            )
        )
    if p.pp_size != d.pp_size:
        out.append(
            Difference(
                "PP size",
                p.pp_size,
                d.pp_size,
                how="regions aligned by layer name; each decode stage pulls the "
                "layers it holds",
            )
        )
    tp_differs = p.tp_size != d.tp_size
    if tp_differs and not _divides(p.tp_size, d.tp_size):
        # Upstream asserts on it (_get_tp_ratio) in prefill's sender task.
        # The pair rule's one home is tp_pairs (the preflight asks it too);
        # a split GQA layer of an MLA model shows below, region by region.
        out.append(Difference("TP size", p.tp_size, d.tp_size, FLAG_TP))
        return Verdict(tuple(out))
    if not scalar_refused:
        out.extend(_region_differences(p, d))
    if tp_differs and not any(x.what == "TP size" for x in out):
        has_mla = any(r.layout == MLA_LAYOUT for r in p.regions)
        out.append(
            Difference(
                "TP size",
                p.tp_size,
                d.tp_size,
                how="MLA latent cache is whole on every rank: each decode rank "
                "pulls it from one prefill rank"
                if has_mla
                else "upstream splits or gathers the KV heads between ranks",
            )
        )
    return Verdict(tuple(out))


def _region_differences(p: Geometry, d: Geometry) -> list[Difference]:
    """Per layer both sides hold: layout and bytes per block (a consequence
    of a refused block size, dtype or draft is not listed again)."""
    out: list[Difference] = []
    mine = {r.layer: r for r in p.regions}
    theirs = {r.layer: r for r in d.regions}
    if p.pp_size == d.pp_size:
        only_p = [n for n in mine if n not in theirs]
        only_d = [n for n in theirs if n not in mine]
        if only_p or only_d:
            out.append(
                Difference(
                    "KV layers",
                    f"{len(mine)} ({len(only_p)} only here: {_few(only_p)})",
                    f"{len(theirs)} ({len(only_d)} only there: {_few(only_d)})",
                    FLAG_MODEL,
                )
            )
    has_mla = any(r.layout == MLA_LAYOUT for r in (*p.regions, *d.regions))
    for name in (n for n in mine if n in theirs):
        a, b = mine[name], theirs[name]
        if a.layout != b.layout:
            out.append(Difference(f"layout of {name}", a.layout, b.layout, FLAG_MODEL))
            continue
        if a.dtype and b.dtype and a.dtype != b.dtype:
            out.append(Difference(f"dtype of {name}", a.dtype, b.dtype, FLAG_KV_DTYPE))
            continue
        same_bytes = a.bytes_per_block == b.bytes_per_block
        # The same bytes in other heads: another head size, other meaning.
        same_heads = not a.heads or not b.heads or a.heads == b.heads
        if same_bytes and same_heads:
            continue
        if _heads_split(a, b, p.tp_size, d.tp_size, has_mla):
            continue  # the TP difference's note says how
        flag = FLAG_TP if p.tp_size != d.tp_size else FLAG_MODEL
        if same_bytes:
            out.append(Difference(f"KV heads of {name}", a.heads, b.heads, flag))
            continue
        out.append(
            Difference(
                f"bytes per block of {name} ({a.layout})",
                a.bytes_per_block,
                b.bytes_per_block,
                flag,
            )
        )
    return out


def _heads_split(a: Region, b: Region, tp_a: int, tp_b: int, has_mla: bool) -> bool:
    """Whether upstream's head split honours GQA regions of different bytes:
    only at different TP, only in a model without MLA regions (upstream
    skips head re-sharding whenever ``use_mla``), with the same bytes per
    head (head size, dtype and block size)."""
    if tp_a == tp_b or has_mla or a.layout != GQA_LAYOUT:
        return False
    if not a.heads or not b.heads:
        return False
    return a.bytes_per_block * b.heads == b.bytes_per_block * a.heads


def _few(names: Sequence[str], n: int = 3) -> str:
    shown = ", ".join(names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


# -- the worker side -------------------------------------------------------------
# Prefill: whether the answer of the pull being served states prefill's
# geometry (the first pull from a decode worker, or of a new geometry).
_STATE_IN_ANSWER: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "pd_geometry_in_answer", default=False
)
# Decode: the prefill worker the running pull goes to.
PEER: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "pd_geometry_peer", default=None
)


class GeometryWorker:
    """Mixed into the connector worker (before upstream's class)."""

    geometry: Geometry | None = None

    def _install_geometry(self) -> None:
        encoder = wire.install(self)
        encoder.pull_fields.append(self._geometry_pull_fields)
        encoder.answer_fields.append(self._geometry_answer_fields)

    def _describe_geometry(self) -> Geometry:
        """This worker's geometry, after its KV caches are registered. A
        worker built without a full vLLM config (the unit tests') gives the
        same facts from its own state: the logical block is kernel blocks
        times the ratio, the KV dtype its regions' dtype."""
        vc = getattr(self, "vllm_config", None)
        cache_config = getattr(vc, "cache_config", None)
        model_config = getattr(vc, "model_config", None)
        specs = getattr(self, "_layer_specs", None) or {}
        caches = getattr(self, "device_kv_caches", None) or {}
        regions = []
        for r in self.regions:
            spec = specs.get(r.layer_name)
            dtype = getattr(spec, "dtype", None)
            if dtype is None and r.layer_name in caches:
                dtype = caches[r.layer_name].dtype
            regions.append(
                Region(
                    r.layer_name,
                    r.layout,
                    r.kv_block_len,
                    int(getattr(spec, "num_kv_heads", 0) or 0),
                    str(dtype).removeprefix("torch.") if dtype is not None else "",
                )
            )
        # Upstream set block_size to the kernel block size.
        kernel = int(self.block_size)
        ratio = int(getattr(self, "_physical_blocks_per_logical_kv_block", 1))
        # Read field by field: an older vLLM (0.19) or a test's stand-in config
        # may lack one; the regions' own dtype and the kernel ratio stand in.
        block_size = int(getattr(cache_config, "block_size", 0) or kernel * ratio)
        kv_dtype = kv_dtype_name(
            getattr(cache_config, "cache_dtype", None) or "auto",
            getattr(model_config, "dtype", None)
            or (regions[0].dtype if regions else ""),
        )
        draft, k = draft_name(getattr(vc, "speculative_config", None))
        return Geometry(
            block_size=block_size,
            kernel_block_size=kernel,
            kv_dtype=kv_dtype,
            tp_rank=int(getattr(self, "tp_rank", 0)),
            tp_size=int(getattr(self, "tp_size", 1)),
            pp_size=int(getattr(self, "pp_size", 1)),
            draft=draft,
            num_speculative_tokens=k,
            regions=tuple(regions),
        )

    def _state_geometry(self) -> None:
        """Called once the regions are known (register_kv_caches)."""
        # Prefill: verdicts by (decode worker, its stated geometry), so each
        # is logged once; decode: prefill workers whose geometry was logged.
        self._geometry_verdicts: dict[tuple[str, Geometry | None], Verdict | None] = {}
        self._geometry_heard: set[tuple[str, Geometry | None]] = set()
        # Prefill: transfer ids of refused pulls not yet released (insertion
        # ordered; the oldest dropped past REFUSED_KEPT).
        self._geometry_refused: dict[str, None] = {}
        self.geometry = self._describe_geometry()
        logger.info(
            "PD Mooncake geometry (%s): %s",
            "decode" if self.is_kv_consumer else "prefill",
            self.geometry.describe(),
        )

    def _geometry_pull_fields(self) -> dict[str, Any]:
        return {"pd_geometry": self.geometry.wire()} if self.geometry else {}

    def _geometry_answer_fields(self, answer: Any) -> dict[str, Any]:
        if self.geometry is None or not _STATE_IN_ANSWER.get():
            return {}
        # Once per pull: its first answer (CONTINUEs follow).
        _STATE_IN_ANSWER.set(False)
        return {"pd_geometry": self.geometry.wire()}

    # prefill ------------------------------------------------------------------
    def _geometry_refusal(self, meta: Any) -> str | None:
        """Why prefill refuses this pull (None: it proceeds); logs each
        decode worker's geometry and verdict once. Sets whether this pull's
        answer states prefill's geometry."""
        if self.geometry is None:
            return None
        peer = f"{meta.remote_hostname}:{meta.remote_port}"
        theirs = Geometry.from_wire(getattr(meta, "pd_geometry", None))
        key = (peer, theirs)
        if key in self._geometry_verdicts:
            verdict = self._geometry_verdicts[key]
        else:
            verdict = self._first_pull(peer, theirs)
            self._geometry_verdicts[key] = verdict
            _STATE_IN_ANSWER.set(True)
        if verdict is None or verdict.refusal is None:
            return None
        if faults.active_fault() == faults.SKIP_GEOMETRY_CHECK:
            logger.warning(
                "TEST FAULT: geometry check skipped, serving decode %s", peer
            )
            return None
        return verdict.refusal

    async def _refuse_pull(
        self, identity: bytes, sock: Any, reason: str, meta: Any
    ) -> None:
        """Answer the pull with upstream's ERROR status (decode fails its
        requests with ``reason``) and free what prefill holds for it: no
        pull of these requests will ever be served."""
        answer = upstream.MooncakeXferResponse(
            status=upstream.MooncakeXferResponseStatus.ERROR, err_msg=reason
        )
        await sock.send_multipart((identity, self._encoder.encode(answer)))
        for transfer_id, _ in meta.req_blocks.values():
            self._geometry_refused[transfer_id] = None
        while len(self._geometry_refused) > REFUSED_KEPT:
            self._geometry_refused.pop(next(iter(self._geometry_refused)))
        self._release_refused()

    def _release_refused(self) -> None:
        """Finish the sends of refused pulls once prefill has computed them
        (a pull can arrive first); upstream would hold their blocks until
        its abort timeout (VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT)."""
        refused = getattr(self, "_geometry_refused", None)
        for transfer_id in list(refused or ()):
            send = self.reqs_need_send.get(transfer_id)
            if send is None or not send.ready.is_set() or getattr(send, "sending", 0):
                continue
            del self.reqs_need_send[transfer_id]
            del refused[transfer_id]
            self.finished_sending_reqs.add(send.p_req_id)

    def _first_pull(self, peer: str, theirs: Geometry | None) -> Verdict | None:
        if theirs is None:
            logger.warning(
                "PD Mooncake geometry: decode %s states no KV geometry (not "
                "PDMooncakeConnector, or an older one): not checked, upstream's "
                "own checks apply",
                peer,
            )
            return None
        verdict = compare(self.geometry, theirs)
        if verdict.refusal is not None:
            # The one line prefill logs for this decode worker.
            logger.error(
                "PD Mooncake: refusing pulls from decode %s: %s (decode: %s)",
                peer,
                verdict.refusal,
                theirs.describe(),
            )
        elif verdict.honoured:
            logger.info(
                "PD Mooncake geometry: decode %s differs, honoured: %s",
                peer,
                "; ".join(str(x) for x in verdict.honoured),
            )
        else:
            logger.info("PD Mooncake geometry: decode %s: the same as prefill's", peer)
        return verdict

    # decode -------------------------------------------------------------------
    def _geometry_answered(self, response: Any) -> None:
        """Log a prefill worker's stated geometry, and how it compares, once
        (the refusal itself reaches decode as the pull's error)."""
        if self.geometry is None:
            return
        peer = PEER.get() or "?"
        theirs = Geometry.from_wire(getattr(response, "pd_geometry", None))
        key = (peer, theirs)
        if key in self._geometry_heard:
            return
        if theirs is None and any(k[0] == peer for k in self._geometry_heard):
            return  # stated in an earlier pull's answer
        self._geometry_heard.add(key)
        if theirs is None:
            logger.warning(
                "PD Mooncake geometry: prefill %s stated no KV geometry (not "
                "PDMooncakeConnector, or an older one): not checked",
                peer,
            )
            return
        verdict = compare(theirs, self.geometry)
        logger.info(
            "PD Mooncake geometry: prefill %s: %s; %s",
            peer,
            theirs.describe(),
            verdict.refusal
            or "; ".join(str(x) for x in verdict.honoured)
            or "the same as decode's",
        )
