"""The model's cache-relevant shape: which layers keep which kind of state, and its size."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import math
from dataclasses import dataclass

import torch

from hicache.types import ComponentType, ConfigError


class LayerKind(enum.Enum):
    """What a model layer is, by the name layouts and configs give it. A layer kind is not
    a :class:`ComponentType` (what the cache keeps): each kind's layers keep one kind of
    cached state, its ``component``."""

    FULL = "full"
    SWA = "swa"
    MAMBA = "mamba"

    @property
    def component(self) -> ComponentType:
        """The kind of cached state layers of this kind keep (the same name)."""
        return ComponentType[self.name]


_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "uint8": torch.uint8,
}

#: The storage dtype of packed Mamba state (see :class:`StateTensor`): raw bytes, so that
#: every copy (kernels, host pages, LMDB values) moves each state tensor bit for bit.
PACKED_STATE_DTYPE = torch.uint8


def dtype_name(dtype: torch.dtype) -> str:
    """The stable name of a dtype, as used in fingerprints and on the wire."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise ConfigError(
            f"unknown dtype {name!r}; use one of {', '.join(sorted(_DTYPES))}"
        ) from None


@dataclass(frozen=True)
class StateTensor:
    """One state tensor that every Mamba/linear-attention layer keeps per state slot.

    Real models keep several per layer (a conv window and a recurrent state, or only a conv
    window), each with its own shape and dtype; a layout that lists them stores a layer's
    states packed one after another as raw bytes (``PACKED_STATE_DTYPE``).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        if not self.name or not self.shape or any(s <= 0 for s in self.shape):
            raise ConfigError(
                f"state tensor {self.name!r} needs a name and a positive shape, got {self.shape}"
            )

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def to_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": dtype_name(self.dtype)}

    @classmethod
    def of(cls, value: StateTensor | dict) -> StateTensor:
        if isinstance(value, StateTensor):
            return value
        return cls(value["name"], tuple(value["shape"]), value["dtype"])


@dataclass(frozen=True)
class ModelLayout:
    """Which layers keep which state, and the shape of that state per token or per slot.

    * full-attention and sliding-window layers keep K and V of shape
      ``[num_kv_heads, head_dim]`` per token;
    * Mamba layers keep a conv state ``[conv_dim, conv_kernel - 1]`` and an SSM state of
      shape ``ssm_state_shape`` per state slot, in ``state_dtype``;
    * or, with ``state_tensors``, any number of state tensors per Mamba layer, each with
      its own shape and dtype. They are stored packed as bytes: the conv part of the pool
      holds the first tensor's bytes and the SSM part the rest (a lone tensor is split in
      two halves), so ``conv_dim``, ``conv_kernel``, ``ssm_state_shape`` and
      ``state_dtype`` are derived and need not be given.
    """

    layer_kinds: tuple[LayerKind, ...]
    num_kv_heads: int = 0
    head_dim: int = 0
    dtype: torch.dtype = torch.bfloat16
    conv_dim: int = 0
    conv_kernel: int = 0
    ssm_state_shape: tuple[int, ...] = ()
    state_dtype: torch.dtype = torch.float32
    model_id: str = "model"
    tp_rank: int = 0
    tp_size: int = 1
    state_tensors: tuple[StateTensor, ...] = ()

    def __post_init__(self) -> None:
        tensors = tuple(StateTensor.of(t) for t in self.state_tensors)
        object.__setattr__(self, "state_tensors", tensors)
        if tensors:
            self._derive_packed_storage(tensors)
        kinds = tuple(LayerKind(k) if not isinstance(k, LayerKind) else k for k in self.layer_kinds)
        object.__setattr__(self, "layer_kinds", kinds)
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        object.__setattr__(self, "state_dtype", parse_dtype(self.state_dtype))
        object.__setattr__(self, "ssm_state_shape", tuple(int(s) for s in self.ssm_state_shape))
        self.validate()

    def _derive_packed_storage(self, tensors: tuple[StateTensor, ...]) -> None:
        names = [t.name for t in tensors]
        if len(set(names)) != len(names):
            raise ConfigError(f"state tensor names must be distinct, got {names}")
        total = sum(t.nbytes for t in tensors)
        head = tensors[0].nbytes if len(tensors) > 1 else (total + 1) // 2
        if total < 2:
            raise ConfigError("packed Mamba state needs at least 2 bytes per layer")
        derived = {
            "conv_dim": head,
            "conv_kernel": 2,
            "ssm_state_shape": (total - head,),
            "state_dtype": PACKED_STATE_DTYPE,
        }
        for name, want in derived.items():
            have = getattr(self, name)
            if name == "state_dtype":
                # float32 is the field's default: it cannot tell "given" from "left out"
                given = parse_dtype(have) not in (torch.float32, PACKED_STATE_DTYPE)
            else:
                have = tuple(have) if name == "ssm_state_shape" else have
                given = have not in (0, ())
            if given and have != want:
                raise ConfigError(
                    f"{name}={have!r} conflicts with state_tensors (packed storage needs "
                    f"{want!r}); leave it out"
                )
            object.__setattr__(self, name, want)

    def state_byte_offsets(self) -> list[tuple[StateTensor, int]]:
        """Each state tensor with the byte offset of its bytes in a layer's packed state."""
        out, offset = [], 0
        for t in self.state_tensors:
            out.append((t, offset))
            offset += t.nbytes
        return out

    def validate(self) -> None:
        """Raise ConfigError naming the first inconsistent field."""
        if not self.layer_kinds:
            raise ConfigError("layout has no layers; give layer_kinds, e.g. ('full', 'mamba')")
        if LayerKind.FULL not in self.layer_kinds:
            raise ConfigError(
                "layout needs at least one full-attention layer: FULL KV is the backbone of "
                "the cache tree"
            )
        if self.has_attention and (self.num_kv_heads <= 0 or self.head_dim <= 0):
            raise ConfigError(
                f"attention layers need num_kv_heads > 0 and head_dim > 0, got "
                f"{self.num_kv_heads} and {self.head_dim}"
            )
        if self.has_mamba:
            if self.conv_dim <= 0 or self.conv_kernel < 2:
                raise ConfigError(
                    f"Mamba layers need conv_dim > 0 and conv_kernel >= 2, got "
                    f"{self.conv_dim} and {self.conv_kernel}"
                )
            if not self.ssm_state_shape or any(s <= 0 for s in self.ssm_state_shape):
                raise ConfigError(
                    f"Mamba layers need a positive ssm_state_shape, got {self.ssm_state_shape}"
                )
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"tp_rank {self.tp_rank} is outside tp_size {self.tp_size}")

    # -- derived -------------------------------------------------------------------------

    def layers_of(self, kind: LayerKind) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k is kind)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return self.layers_of(LayerKind.FULL)

    @property
    def swa_layers(self) -> tuple[int, ...]:
        return self.layers_of(LayerKind.SWA)

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        return self.layers_of(LayerKind.MAMBA)

    @property
    def has_attention(self) -> bool:
        return bool(self.full_layers or self.swa_layers)

    @property
    def has_swa(self) -> bool:
        return bool(self.swa_layers)

    @property
    def has_mamba(self) -> bool:
        return bool(self.mamba_layers)

    @property
    def components(self) -> tuple[ComponentType, ...]:
        """The tree components this layout needs, FULL (every layout has full-attention
        layers) first."""
        return tuple(sorted({kind.component for kind in self.layer_kinds}))

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    def kv_bytes_per_token(self, kind: LayerKind) -> int:
        """Bytes of K and V of one token across all layers of ``kind``."""
        per_layer = 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize
        return per_layer * len(self.layers_of(kind))

    @property
    def conv_state_bytes(self) -> int:
        return math.prod(self.conv_state_shape) * self.state_dtype.itemsize

    @property
    def ssm_state_bytes(self) -> int:
        return math.prod(self.ssm_state_shape) * self.state_dtype.itemsize

    @property
    def mamba_state_bytes(self) -> int:
        """Bytes of one state slot (conv + SSM) across all Mamba layers."""
        return (self.conv_state_bytes + self.ssm_state_bytes) * len(self.mamba_layers)

    def page_bytes(self, component: ComponentType, page_size: int) -> int:
        """Bytes of one page of ``component`` in the page-first host layout."""
        if component is ComponentType.FULL:
            return self.kv_bytes_per_token(LayerKind.FULL) * page_size
        if component is ComponentType.SWA:
            return self.kv_bytes_per_token(LayerKind.SWA) * page_size
        return self.mamba_state_bytes

    # -- identity ------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """A msgpack/JSON-safe description, the inverse of :meth:`from_dict`."""
        d = dataclasses.asdict(self)
        d["layer_kinds"] = [k.value for k in self.layer_kinds]
        d["dtype"] = dtype_name(self.dtype)
        d["state_dtype"] = dtype_name(self.state_dtype)
        d["ssm_state_shape"] = list(self.ssm_state_shape)
        d["state_tensors"] = [t.to_dict() for t in self.state_tensors]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ModelLayout:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown layout field(s) {sorted(unknown)}")
        d = dict(d)
        d["layer_kinds"] = tuple(LayerKind(k) for k in d["layer_kinds"])
        d["ssm_state_shape"] = tuple(d.get("ssm_state_shape", ()))
        d["state_tensors"] = tuple(StateTensor.of(t) for t in d.get("state_tensors", ()))
        return cls(**d)

    def fingerprint(self, page_size: int) -> bytes:
        """A 16-byte digest of everything that makes cached bytes of this layout usable.

        It seeds every page hash chain, so caches of different layouts never share keys.
        """
        parts = [
            "hicache-layout-v1",
            self.model_id,
            ",".join(k.value for k in self.layer_kinds),
            str(self.num_kv_heads),
            str(self.head_dim),
            dtype_name(self.dtype),
            str(self.conv_dim),
            str(self.conv_kernel),
            "x".join(map(str, self.ssm_state_shape)),
            dtype_name(self.state_dtype),
            str(self.tp_rank),
            str(self.tp_size),
            str(page_size),
        ]
        if self.state_tensors:  # only then: fingerprints of older layouts stay as they were
            parts.append(
                ";".join(
                    f"{t.name}:{'x'.join(map(str, t.shape))}:{dtype_name(t.dtype)}"
                    for t in self.state_tensors
                )
            )
        return hashlib.blake2b("|".join(parts).encode(), digest_size=16).digest()
