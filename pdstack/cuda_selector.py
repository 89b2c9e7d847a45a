"""vLLM's CUDA attention-backend selector, asked from any host (pdstack.preflight).

Everything here is vLLM's own code: the candidates and their priorities
(``CudaPlatform.get_valid_backends``), each backend's reasons, the block size
the engine would choose (``_preferred_block_size_for_backends``) and the kernel
block size the Mooncake connector registers with (``select_common_block_size``).
What this module adds is the reading of the answer on a host that lacks CUDA
kernels: a backend that cannot be loaded here, or whose only reasons are
missing kernels, is unknown, never a rejection.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import sys
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

# Reasons meaning "this backend's code or kernels are missing on this host"
# (an import failure, a kernel library not built): they say nothing about the
# configuration, so they make a backend unknown, never a rejection.
EXCEPTIONS = ("ImportError", "ModuleNotFoundError", "OSError")
AVAILABILITY = (
    *EXCEPTIONS,
    "is not available",
    "not compiled",
    "not installed",
    "requires FlashInfer",
    "not supported on this device",
)


@dataclass
class Layer:
    """vLLM's verdict on one kind of attention layer on one GPU class."""

    model: str
    kind: str  # MLA or GQA
    head_size: int
    num_heads: int
    status: str = "unknown"  # accepted, rejected, unknown
    pick: str | None = None
    # The pick validated, but its kernels are not built here.
    pick_unbuilt: bool = False
    # Higher-priority backends this host could not load, so could not ask.
    not_asked_before: list[str] = field(default_factory=list)
    reasons: dict[str, list[str]] = field(default_factory=dict)
    batch_invariant_pick: str | None = None


@functools.cache
def vllm() -> types.SimpleNamespace:
    """vLLM's pieces (imported once: about 5 s)."""
    if importlib.util.find_spec("vllm._C_stable_libtorch") is None:
        # CPU builds lack the CUDA custom-op library vllm.platforms.cuda imports
        # for its side effect (op registration); selection never calls an op.
        # On a CUDA build the real module is found and never stubbed.
        sys.modules.setdefault(
            "vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch")
        )
    import vllm.platforms.cuda as cuda
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.config.cache import CacheConfig
    from vllm.config.model import str_dtype_to_torch_dtype
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig
    from vllm.v1.worker.utils import select_common_block_size

    return types.SimpleNamespace(
        cuda=cuda,
        # Some backends read the current config while validating (FlashInfer
        # sparse MLA): a default one is what an unconfigured engine has.
        config=VllmConfig(),
        set_config=set_current_vllm_config,
        default_block_size=CacheConfig.DEFAULT_BLOCK_SIZE,
        torch_dtype=str_dtype_to_torch_dtype,
        capability=DeviceCapability,
        backend=AttentionBackendEnum,
        selector_config=AttentionSelectorConfig,
        common_block_size=select_common_block_size,
    )


@contextlib.contextmanager
def _asking(v: types.SimpleNamespace) -> Iterator[set[str]]:
    """vLLM's selector, recording the backends whose class fails to import."""
    original = v.cuda._get_attn_backend_class
    unloadable: set[str] = set()

    def load(backend: Any) -> Any:
        try:
            return original(backend)
        except (ImportError, OSError):
            unloadable.add(backend.name)
            raise
        except Exception as exc:
            # CUTLASS_MLA allocates a CUDA tensor when its module is imported:
            # without CUDA that is an AssertionError, which get_valid_backends
            # does not catch (only ImportError/OSError), and the whole call
            # would crash. It means what an ImportError means: not loadable here.
            unloadable.add(backend.name)
            raise ImportError(f"{type(exc).__name__}: {exc}") from exc

    v.cuda._get_attn_backend_class = load
    try:
        with v.set_config(v.config):
            yield unloadable
    finally:
        v.cuda._get_attn_backend_class = original


def is_availability(reason: str) -> bool:
    return any(marker in reason for marker in AVAILABILITY)


def select(
    capability: tuple[int, int], selector: Any, num_heads: int
) -> tuple[Layer, dict[str, Any]]:
    """vLLM's verdict for one kind of layer (model and kind left empty), and
    the picked backend's class by name.

    Accepted: a backend validates, or its only reasons are missing kernels
    (the pick is the first such, in vLLM's priority order). Rejected: every
    backend that could be asked gave a configuration reason. Unknown: none
    could be asked."""
    # Cached: vLLM's imports are not idempotent on a CPU build (a second
    # import of a half-imported module can succeed), so ask once.
    layer, classes = _select(capability, selector, num_heads)
    return copy.deepcopy(layer), classes


@functools.cache
def _select(
    capability: tuple[int, int], selector: Any, num_heads: int
) -> tuple[Layer, dict[str, Any]]:
    v = vllm()
    with _asking(v) as unloadable:
        valid, invalid = v.cuda.CudaPlatform.get_valid_backends(
            v.capability(*capability), selector, num_heads=num_heads
        )
    classes = {c.backend.name: c.backend_class for c in valid}
    ranked = [(c.priority, c.backend.name, []) for c in valid]
    ranked += [(p, b.name, list(r)) for b, (p, r) in invalid.items()]
    layer = Layer("", "", selector.head_size, num_heads)
    for _, name, reasons in sorted(ranked):
        if reasons:
            layer.reasons[name] = reasons
        exception = all(r.split(":")[0] in EXCEPTIONS for r in reasons)
        if name in unloadable or (reasons and exception):
            # Not asked: its class (or its validation) did not load here.
            if layer.pick is None:
                layer.not_asked_before.append(name)
        elif layer.pick is None and not any(not is_availability(r) for r in reasons):
            layer.pick, layer.pick_unbuilt = name, bool(reasons)
            if name not in classes:  # validated but not built: its class loads
                classes = {**classes, name: original_class(v, name)}
    if layer.pick is not None:
        layer.status = "accepted"
    elif set(layer.reasons) - set(layer.not_asked_before):
        layer.status = "rejected"
    return layer, {k: c for k, c in classes.items() if k == layer.pick}


def pick(capability: tuple[int, int], selector: Any, num_heads: int) -> str | None:
    return select(capability, selector, num_heads)[0].pick


def accepted_values(
    capability: tuple[int, int],
    selector: Any,
    num_heads: int,
    field: str,
    values: tuple[Any, ...],
) -> list[tuple[Any, str]]:
    """(value, backend vLLM would pick) for each value of one selector field
    that makes the layer accepted (dtype values by name)."""
    v = vllm()
    typed = [v.torch_dtype(x) if field == "dtype" else x for x in values]
    picks = [
        pick(capability, selector._replace(**{field: t}), num_heads) for t in typed
    ]
    return [(x, p) for x, p in zip(values, picks, strict=True) if p]


def original_class(v: types.SimpleNamespace, name: str) -> Any:
    return v.cuda._get_attn_backend_class(v.backend[name])


def run_dtype(
    flag: str, checkpoint: Mapping[str, Any], capability: tuple[int, int]
) -> str:
    """The dtype vLLM runs: the ``dtype`` flag, else (``auto``) the checkpoint's,
    a float32 one downcast to the platform's first supported dtype, as
    vllm.config.model._resolve_auto_dtype does."""
    if flag != "auto":
        return flag
    name = str(checkpoint.get("torch_dtype") or checkpoint.get("dtype") or "bfloat16")
    if name != "float32":
        return name
    v = vllm()
    cap = v.capability(*capability)
    at = types.SimpleNamespace(has_device_capability=lambda c: cap.to_int() >= c)
    first = v.cuda.CudaPlatform.supported_dtypes.fget(at)[0]
    return str(first).removeprefix("torch.")


def block_sizes(classes: list[Any], block_size: int | None) -> tuple[int, int]:
    """(the engine's block size, the connector's kernel block size).

    Without ``--block-size`` the engine takes the smallest size every backend
    accepts (Platform.update_block_size_for_backend); the Mooncake connector
    then registers at the common kernel block size of all backends, as its
    ``_sync_block_size_with_kernel`` does. Raises ValueError when none fits."""
    v = vllm()
    with v.set_config(v.config):
        if block_size is None:
            block_size = v.cuda.CudaPlatform._preferred_block_size_for_backends(
                classes, v.default_block_size, v.config
            )
        return block_size, v.common_block_size(block_size, classes)
