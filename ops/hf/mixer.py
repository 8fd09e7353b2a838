"""The mixer inside a VLM's vision tower: :func:`use_mixer` routes chosen vision attention
layers through doubly-stochastic low-rank mixing (``kl_project`` + ``thin_mix``, the
parametrisation of :class:`headscope.FactorMixer`) of their own q, k and v.

The swap registers one attention implementation, ``"headscope_mixer"``, in transformers'
``AttentionInterface`` and puts the vision config on it. Every attention module of that
config then calls :func:`attention_forward`: a module carrying a mixer (the submodule
``headscope_mixer``) mixes, the others call the implementation the model was loaded with.
Qwen-VL towers call a non-flash implementation once per image (or window) of their
``cu_seqlens``, so each call is one problem and packed images never mix; SigLIP-style
towers pass a padding mask, and each image is mixed over its unpadded patches only.
"""
from __future__ import annotations

import weakref
from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor, nn

from ..mixer import FactorMixer
from .backend import base_functions, eager_function

NAME = "headscope_mixer"
SUBMODULE = "headscope_mixer"  # the mixer's attribute on a swapped attention module
WHO = "headscope.hf.use_mixer"
WHERE = ("vision",)

# id(vision config) -> (its _attn_implementation_internal as loaded, the attention function
# of that implementation or None for the modeling file's eager one, its mask function)
_BASE: Dict[int, tuple] = {}


def _base(config) -> tuple:
    base = _BASE.get(id(config))
    if base is None:
        raise RuntimeError(
            f"headscope.hf: the attention implementation is {NAME!r} but no use_mixer handle "
            f"is attached to this config (a copy of a swapped model?); set "
            f"`config._attn_implementation` back to the one the model was loaded with")
    return base


def attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Optional[Tensor], **kwargs):
    """transformers' attention-function signature: ``(B, H, n, d)`` in, ``(B, n, H, d)``
    and no weights out."""
    mixer = module._modules.get(SUBMODULE)
    if mixer is None:
        _, attention, _ = _base(module.config)
        attention = attention or eager_function(module, WHO)
        return attention(module, query, key, value, attention_mask, **kwargs)
    if kwargs.get("is_causal"):
        raise ValueError(f"{WHO}: {type(module).__name__} asked for causal attention; a "
                         f"doubly-stochastic mixing cannot be causal (swap bidirectional "
                         f"vision attention only)")
    if kwargs.get("dropout", 0.0):
        raise ValueError(f"{WHO}: {type(module).__name__} asked for attention dropout "
                         f"{kwargs['dropout']}, which the mixer has no equivalent of; set "
                         f"the vision config's attention_dropout to 0")
    if key.shape[1] != query.shape[1]:  # grouped key/value heads
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
    return mix_padded(mixer, query, key, value, attention_mask).transpose(1, 2).contiguous(), None


def mix_padded(mixer: FactorMixer, query: Tensor, key: Tensor, value: Tensor,
               attention_mask: Optional[Tensor]) -> Tensor:
    """``mixer(query, key, value)`` with each batch row mixed over the positions its
    padding mask keeps; padded query rows are zero. ``(B, H, n, d)`` -> ``(B, H, n, dv)``."""
    keep = key_padding(attention_mask, query.shape[0], query.shape[2])
    if keep is None or bool(keep.all()):
        return mixer(query, key, value)
    rows = []
    for b in range(query.shape[0]):
        index = keep[b].nonzero().squeeze(1)
        row = value.new_zeros(value.shape[1:])
        if index.numel():
            mixed = mixer(*(t[b:b + 1].index_select(2, index) for t in (query, key, value)))
            row = row.index_copy(1, index, mixed[0])
        rows.append(row)
    return torch.stack(rows)


def key_padding(mask: Optional[Tensor], batch: int, n: int) -> Optional[Tensor]:
    """The ``(batch, n)`` positions a padding mask keeps (None: all): a 2D ``(B, n)`` mask
    (flash attention's), or a 4D boolean (sdpa: True attends) or additive (eager: 0 attends,
    the dtype's minimum blocks) mask whose query rows are all alike. A mask that biases
    attention or differs between query rows is no padding mask and raises."""
    if mask is None:
        return None
    if mask.dim() == 2:
        return mask.bool().expand(batch, n)
    if mask.dim() != 4:
        raise ValueError(f"{WHO}: attention mask of shape {list(mask.shape)}; the mixer takes "
                         f"a (B, n) or (B, 1, n, n) padding mask")
    if mask.dtype == torch.bool:
        attend = mask
    else:
        attend = mask == 0
        if not bool((attend | (mask <= torch.finfo(mask.dtype).min)).all()):
            raise ValueError(f"{WHO}: the additive attention mask holds values other than 0 "
                             f"and the dtype's minimum (an attention bias); the mixer takes "
                             f"padding masks only")
    if not bool((attend == attend[:, :, :1, :]).all()):
        raise ValueError(f"{WHO}: the attention mask differs between query rows (not a "
                         f"padding mask); the mixer mixes whole images and takes padding "
                         f"masks only")
    return attend[:, 0, 0, :].expand(batch, n)


def mask_function(*args, **kwargs):
    """transformers' mask interface for the swapped config: the base implementation's,
    whose masks the unswapped layers receive and :func:`key_padding` reads."""
    return _base(kwargs.get("config"))[2](*args, **kwargs)


def register() -> None:
    """Registers :data:`NAME` in transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, mask_function)


def vision_attention_modules(model: nn.Module) -> List[nn.Module]:
    """The vision tower's attention modules, in block order: the modules named
    ``*Attention`` whose config is the model's ``vision_config``."""
    config = getattr(getattr(model, "config", None), "vision_config", None)
    if config is None:
        raise ValueError(f"{WHO}: {type(model).__name__} has no config.vision_config; pass a "
                         f"transformers vision-language model")
    found = [m for m in model.modules()
             if type(m).__name__.endswith("Attention") and getattr(m, "config", None) is config]
    if not found:
        raise ValueError(f"{WHO}: no attention module of {type(model).__name__} uses its "
                         f"vision config")
    for m in found:
        if not (isinstance(getattr(m, "num_heads", None), int)
                and isinstance(getattr(m, "head_dim", None), int)):
            raise ValueError(f"{WHO}: {type(m).__name__} has no integer num_heads and "
                             f"head_dim attributes; its family is not supported")
    return found


class MixerHandle:
    """What :func:`use_mixer` returns: ``mixers`` (one :class:`~headscope.FactorMixer` per
    swapped layer, keyed by its index in ``modules``, the tower's attention modules),
    ``named_parameters()``, ``load(folder)``, ``undo()``, and a context manager that undoes
    on exit."""

    def __init__(self, model: nn.Module, modules: Sequence[nn.Module], mixers: Dict[int, FactorMixer]):
        self.model = model
        self.mixers = mixers
        self.modules = list(modules)  # the tower's attention modules, in block order
        self._configs = {id(m.config): m.config for m in modules}
        self._active = True

    def undo(self) -> None:
        """Removes the mixers and puts the vision config back on the implementation the
        model was loaded with (idempotent)."""
        if not self._active:
            return
        for index in self.mixers:
            del self.modules[index]._modules[SUBMODULE]
        for key, config in self._configs.items():
            config._attn_implementation_internal = _BASE.pop(key)[0]
        self._active = False

    def named_parameters(self):
        """``(name in the model, parameter)`` of every mixer."""
        return [(name, p) for name, p in self.model.named_parameters() if is_mixer_key(name)]

    def load(self, folder) -> None:
        """Loads the mixer parameters from ``folder``, written by ``save_pretrained``
        while mixers were attached (load the model with ``from_pretrained``, which skips
        these keys, call :func:`use_mixer` with the same rank and layers, then this).
        Checkpoint keys may drop a prefix of the model's names (transformers saves
        ``model.visual.…`` as ``visual.…``): each parameter takes the one saved key that
        ends its name."""
        saved = _mixer_tensors(folder)
        for name, param in self.named_parameters():
            keys = [k for k in saved if f".{name}".endswith(f".{k}")]
            if len(keys) != 1:
                raise ValueError(f"{WHO}: {len(keys)} tensors in {folder} match the mixer "
                                 f"parameter {name} (saved mixer keys: {sorted(saved)[:4]}…); "
                                 f"call use_mixer with the layers the checkpoint was saved "
                                 f"with")
            tensor = saved.pop(keys[0])
            if tensor.shape != param.shape:
                raise ValueError(f"{WHO}: {keys[0]} in {folder} has shape "
                                 f"{list(tensor.shape)}, the model's {name} "
                                 f"{list(param.shape)}; call use_mixer with the rank the "
                                 f"checkpoint was saved with")
            with torch.no_grad():
                param.copy_(tensor)
        if saved:
            raise ValueError(f"{WHO}: {folder} holds mixer parameters for layers this handle "
                             f"did not swap ({sorted(saved)[:4]}); call use_mixer with the "
                             f"layers the checkpoint was saved with")

    def __enter__(self) -> "MixerHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


def is_mixer_key(name: str) -> bool:
    """Whether a parameter or checkpoint key belongs to a swapped layer's mixer."""
    return f".{SUBMODULE}." in f".{name}"


def _safetensors_files(folder) -> list:
    from pathlib import Path
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{WHO}: no .safetensors file in {folder}")
    return files


def _mixer_tensors(folder) -> Dict[str, Tensor]:
    """The mixer tensors of the safetensors files in ``folder`` (sharded or not)."""
    from safetensors import safe_open
    out = {}
    for path in _safetensors_files(folder):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                if is_mixer_key(key):
                    out[key] = f.get_tensor(key)
    if not out:
        raise ValueError(f"{WHO}: {folder} holds no mixer parameters (keys containing "
                         f"'{SUBMODULE}'); save the model with save_pretrained while the "
                         f"mixers are attached")
    return out


def saved_mixer_rank(folder) -> int:
    """The rank of the mixers saved in ``folder`` by ``save_pretrained`` (read from the
    checkpoint's shapes, no tensor loaded); 0 when it holds none."""
    from safetensors import safe_open
    ranks = set()
    for path in _safetensors_files(folder):
        with safe_open(str(path), "pt") as f:
            ranks |= {f.get_slice(k).get_shape()[-1] for k in f.keys()
                      if is_mixer_key(k) and k.endswith(".w_q")}
    if len(ranks) > 1:
        raise ValueError(f"{WHO}: the mixers saved in {folder} have different ranks "
                         f"{sorted(ranks)}")
    return ranks.pop() if ranks else 0


def use_mixer(model: nn.Module, rank: int, where: str = "vision",
              layers: Optional[Sequence[int]] = None, *, temperature: float = 3.0,
              tol: float = 1e-10, max_iter: int = 50, check: bool = True) -> MixerHandle:
    """Swaps the attention of the chosen vision layers (``layers``: indices into the
    tower's attention modules in block order; None: all) for doubly-stochastic mixing of
    rank ``rank``. Each swapped module gains a trainable :class:`~headscope.FactorMixer`
    (``temperature``, ``tol``, ``max_iter``, ``check`` as there) as its submodule
    ``headscope_mixer``, float32 on the module's device. Returns a :class:`MixerHandle`."""
    if where not in WHERE:
        raise ValueError(f"{WHO}: where must be one of {WHERE}, got {where!r} (the text "
                         f"decoder is causal, which a doubly-stochastic mixing cannot be)")
    modules = vision_attention_modules(model)
    chosen = list(range(len(modules))) if layers is None else list(layers)
    bad = [i for i in chosen if not isinstance(i, int) or not 0 <= i < len(modules)]
    if bad or len(set(chosen)) != len(chosen):
        raise ValueError(f"{WHO}: layers must be distinct indices in [0, {len(modules)}) "
                         f"(the vision tower's attention layers), got {list(layers)}")
    configs = {id(m.config): m.config for m in modules}
    for config in configs.values():
        if config._attn_implementation_internal == NAME or id(config) in _BASE:
            raise RuntimeError(f"{WHO}: the vision tower already has mixers; undo the "
                               f"first handle before swapping again")
    register()
    for key, config in configs.items():
        loaded = config._attn_implementation_internal  # restored as is, None included
        _BASE[key] = (loaded, *base_functions(loaded or "eager", WHO))
        # a model dropped without undo must not leave its entry to a later config of its id
        weakref.finalize(config, _BASE.pop, key, None)
    mixers = {}
    for index in chosen:
        module = modules[index]
        device = next(module.parameters()).device
        mixer = FactorMixer(module.num_heads, module.head_dim, rank, temperature=temperature,
                            tol=tol, max_iter=max_iter, check=check).to(device)
        module.add_module(SUBMODULE, mixer)
        mixers[index] = mixer
    for config in configs.values():
        config._attn_implementation_internal = NAME
    return MixerHandle(model, modules, mixers)
