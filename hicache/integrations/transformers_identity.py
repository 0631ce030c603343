"""Which transformers model computed a page: the model id that seeds every page hash.

A page's bytes are usable only by the model that computed them. The layout fingerprint
(shapes, dtypes, page size) cannot tell two models of one family apart when their cached
tensors happen to have the same shapes (a different hidden size behind the same KV heads
and Mamba states, or another checkpoint of the same config), so the layout's ``model_id``
carries the model's identity:

* its name or path and revision (``config._commit_hash``, set when loaded from the Hub);
* a digest of the full config (``config.to_dict()`` as canonical JSON), without the fields
  that do not change what the model computes (:data:`VOLATILE_CONFIG_KEYS`);
* a digest of the weights that is cheap to compute: of every tensor of the state dict, its
  name, shape and dtype and a fixed sample of its elements (the first and last
  :data:`WEIGHT_EDGE_ELEMENTS` and :data:`WEIGHT_SPREAD_ELEMENTS` spread evenly between).
  Another checkpoint or seed changes it; an edit of a few elements that the sample misses
  does not: name such a model apart with a user ``model_id``;
* an optional ``model_id`` given by the user (an adapter, a fine-tune, a deployment name).

The served dtype is in the layout itself. Two models that differ in any of these never
share a page on any tier: an in-process controller or sidecar serving one refuses the
other's engines, and the disk and remote tiers never serve a page of another fingerprint.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

#: ``to_dict()`` keys left out of the config digest: the library version, where the config
#: came from (carried apart), the dtype (the layout carries the one served) and output
#: switches; none changes the bytes a model caches.
VOLATILE_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "_commit_hash",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "architectures",
        "use_cache",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "_attn_implementation_autoset",
    }
)
WEIGHT_EDGE_ELEMENTS = 8
WEIGHT_SPREAD_ELEMENTS = 16
_DIGEST_BYTES = 8
_MAX_NAME_CHARS = 256


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=_DIGEST_BYTES).hexdigest()


def _stable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _stable(v) for k, v in value.items() if k not in VOLATILE_CONFIG_KEYS}
    if isinstance(value, (list, tuple)):
        return [_stable(v) for v in value]
    return value


def config_digest(config: Any) -> str:
    """A digest of ``config.to_dict()`` (nested configs included; the attributes of a
    config object without one) as canonical JSON, less :data:`VOLATILE_CONFIG_KEYS`."""
    to_dict = getattr(config, "to_dict", None)
    fields = to_dict() if to_dict is not None else dict(vars(config))
    text = json.dumps(_stable(fields), sort_keys=True, default=str)
    return _digest(text.encode())


def _sample_positions(n: int) -> list[int]:
    edge = WEIGHT_EDGE_ELEMENTS
    spread = [i * n // (WEIGHT_SPREAD_ELEMENTS + 1) for i in range(1, WEIGHT_SPREAD_ELEMENTS + 1)]
    return sorted({*range(min(edge, n)), *range(max(0, n - edge), n), *spread})


def weights_digest(model: torch.nn.Module) -> str:
    """A digest of every state-dict tensor's name, shape, dtype and fixed element sample
    (a few hundred bytes per tensor moved to the CPU, whatever the model's size)."""
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    for name, tensor in sorted(model.state_dict().items()):
        h.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        if tensor.device.type == "meta" or tensor.numel() == 0:
            continue
        flat = tensor.detach().reshape(-1)
        index = torch.tensor(_sample_positions(flat.numel()), device=flat.device)
        sample = flat.index_select(0, index).contiguous().view(torch.uint8)
        h.update(sample.cpu().numpy().tobytes())
    return h.hexdigest()


def _bounded(text: str) -> str:
    """``text``, or its digest where it is too long to show (the wire bounds a model id)."""
    return text if len(text) <= _MAX_NAME_CHARS else "digest-" + _digest(text.encode())


def _source(config: Any) -> str:
    name = _bounded(str(getattr(config, "_name_or_path", "") or ""))
    revision = getattr(config, "_commit_hash", None)
    return f"{name}@{revision}" if revision else name


def model_identity(
    config: Any, model_type: str, weights: str | None = None, model_id: str | None = None
) -> str:
    """The ``model_id`` of a transformers model's layout: ``hf:<family>``, then its name
    and revision, the config digest, the weights digest (:func:`weights_digest`, where
    the weights are at hand) and the user's ``model_id``, each where there is one."""
    parts = [f"hf:{model_type}"]
    source = _source(config)
    if source:
        parts.append(f"name={source}")
    parts.append(f"config={config_digest(config)}")
    if weights is not None:
        parts.append(f"weights={weights}")
    if model_id:
        parts.append(f"id={_bounded(model_id)}")
    return "|".join(parts)
