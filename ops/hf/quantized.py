"""Quantized weights as headscope reads them: a model loaded with a transformers
``quantization_config`` (torchao, optimum-quanto, bitsandbytes) keeps each linear layer's
weight in its backend's own tensor type, which is no ``(out, in)`` matrix one can slice.

- :func:`dense_weight`: the matrix a linear layer's forward multiplies by, whatever the
  weight's type (the value norms and ``writes="residual"`` of the Tracer read ``o_proj``
  through it).
- :func:`check_input_gradients`: whether a model's quantized linear layers pass the
  gradient of their weights to their inputs, which input x gradient and AttnLRP need;
  a scheme that does not (a kernel without a backward, activations quantized in the
  forward) is refused with the reason.
"""
from __future__ import annotations

import torch

__all__ = ["check_input_gradients", "dense_weight", "dequantized", "is_quantized"]

# relative error allowed between a quantized layer's input gradient and the one its dense
# weight gives: bfloat16 rounding of the gradient (2^-8) with room; a layer that quantizes
# its input in the forward passes a gradient off by about 1 (through its scale only)
GRADIENT_TOLERANCE = 5e-2


def is_quantized(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a backend's own tensor type rather than a plain tensor."""
    return type(weight) not in (torch.Tensor, torch.nn.Parameter)


def _activation_dtype(weight: torch.Tensor) -> torch.dtype:
    """The floating dtype the layer's inputs have: the weight's own dtype (torchao and
    optimum-quanto report the original one), bitsandbytes' quantisation state's, else
    float32."""
    if weight.dtype.is_floating_point:
        return weight.dtype
    state = getattr(weight, "quant_state", None)
    dtype = getattr(state, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point \
        else torch.float32


def dequantized(weight: torch.Tensor):
    """A quantized weight's own ``dequantize()`` (torchao, optimum-quanto): a plain
    floating tensor of the weight's shape; None where the weight has none that gives one
    (bitsandbytes' packed bytes, torchao's CPU int4 layout). A weight that reports an
    integer dtype holds packed bytes (torch's own ``Tensor.dequantize`` would cast them)."""
    if not weight.dtype.is_floating_point:
        return None
    try:
        dense = weight.dequantize()
    except (NotImplementedError, RuntimeError):
        return None
    if isinstance(dense, torch.Tensor) and not is_quantized(dense) \
            and dense.dtype.is_floating_point and dense.shape == weight.shape:
        return dense.detach()
    return None


def dense_weight(linear: torch.nn.Module) -> torch.Tensor:
    """The ``(out, in)`` matrix ``linear``'s forward multiplies its input by, as a plain
    tensor: the weight itself when it is one; a quantized weight's own ``dequantize()``
    (torchao, optimum-quanto); bitsandbytes' ``dequantize_4bit`` of a 4-bit weight in its
    stored layout; else the layer's output for the identity matrix minus its bias
    (torchao's CPU int4 layout, a bitsandbytes weight repacked for its CPU kernel:
    whatever the forward computes, in the dtype of its inputs). Detached, on the layer's
    device. Only a layout with no reading of its own runs the layer's forward."""
    weight = linear.weight
    if not is_quantized(weight):
        return weight.detach()
    shape = (linear.out_features, linear.in_features)
    dense = dequantized(weight)
    if dense is None:
        dense = _bitsandbytes_4bit(weight)
    if dense is not None and dense.shape == shape:
        return dense
    eye = torch.eye(shape[1], dtype=_activation_dtype(weight), device=weight.device)
    with torch.no_grad():
        columns = linear(eye)
        if getattr(linear, "bias", None) is not None:
            columns = columns - linear.bias.to(columns.dtype)
    return columns.T.contiguous()


def _bitsandbytes_4bit(weight: torch.Tensor):
    """A bitsandbytes 4-bit weight in its stored layout, dequantized (None for any other
    weight, and for one repacked for bitsandbytes' CPU kernel, which its forward reads).
    Its forward without gradients would repack it: this reads it as it is."""
    state = getattr(weight, "quant_state", None)
    if state is None or getattr(state, "packing_format_for_cpu", False) \
            or not hasattr(state, "blocksize"):
        return None
    from bitsandbytes.functional import dequantize_4bit
    return dequantize_4bit(weight.data, state).detach()


def check_input_gradients(model: torch.nn.Module, who: str) -> None:
    """Raises NotImplementedError, naming the layer and why, when a quantized linear layer
    of ``model``'s text decoder or output layer (what a gradient with respect to the
    decoder's input embeddings passes) does not pass its input the gradient its dense
    weight gives (``grad_x = grad_y W``): its kernel has no backward, or the forward
    quantizes the input too (dynamic activation quantization), so that the gradient
    reaches the input only through the quantization scale. One small probe per kind of
    layer and weight."""
    from .families import family_of
    names = {id(m): name for name, m in model.named_modules()}
    modules = list(family_of(model, who).decoder(model).modules()) + \
        [model.get_output_embeddings()]
    seen = set()
    for linear in modules:
        if not isinstance(linear, torch.nn.Linear) or not is_quantized(linear.weight):
            continue
        kind = (type(linear), type(linear.weight))
        error = _known_cause(linear)
        if error is None and kind not in seen:
            seen.add(kind)
            error = _gradient_error(linear)
        if error is not None:
            raise NotImplementedError(
                f"{who}: {names.get(id(linear), type(linear).__name__)} "
                f"({type(linear).__name__} with {type(linear.weight).__name__} weights) "
                f"{error} (docs/hf.md, Quantized weights)")


def _known_cause(linear: torch.nn.Module):
    """Why ``linear`` passes no gradient, where its state alone tells: bitsandbytes (on a
    CPU with AVX512-BF16) repacks a 4-bit weight for its CPU inference kernel at the
    layer's first forward without gradients, and that kernel has no backward."""
    state = getattr(linear.weight, "quant_state", None)
    if getattr(state, "packing_format_for_cpu", False):
        return ("passes no gradient to its input: bitsandbytes repacked its 4-bit weight "
                "for its CPU inference kernel, which has no backward, at the model's first "
                "forward without gradients (CPUs with AVX512-BF16); take gradients on a "
                "freshly loaded model, before any forward without them")
    return None


def _gradient_error(linear: torch.nn.Module):
    """Why ``linear`` does not pass its input the gradient of its dense weight (None: it
    does)."""
    weight = linear.weight
    dense = dense_weight(linear).float()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, dense.shape[1], generator=generator).to(weight.device,
                                                               _activation_dtype(weight))
    grad_out = torch.randn(3, dense.shape[0], generator=generator).to(weight.device)
    x.requires_grad_(True)
    flags = [(p, p.requires_grad) for p in linear.parameters(recurse=False)]
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        with torch.enable_grad():
            out = linear(x)
            if not out.requires_grad:
                return ("passes no gradient to its input: its output is not "
                        "differentiable in it (a forward that quantizes the input too, as "
                        "dynamic activation quantization does); gradients need the weights "
                        "quantized alone")
            (grad,) = torch.autograd.grad((out.float() * grad_out).sum(), x)
    except RuntimeError as e:
        return (f"passes no gradient to its input ({str(e).splitlines()[0]}); gradients "
                f"need a scheme whose kernels have a backward")
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
    want = grad_out @ dense
    error = float((grad.float() - want).norm() / want.norm())
    if not error <= GRADIENT_TOLERANCE:
        return (f"passes its input a gradient {error:.2g} away (relative) from its weights': "
                f"its forward quantizes the input too (dynamic activation quantization), and "
                f"the gradient reaches the input only through the quantization scale; "
                f"gradients need the weights quantized alone")
    return None
