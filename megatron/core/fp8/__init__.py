"""FP8 training on PyTorch's own primitives (`torch._scaled_mm`, `torch.float8_e4m3fn` /
`float8_e5m2`): Megatron-LM's FP8 recipes for the linear layers of transformer layers.

- `recipe.py`: formats, recipes, the config's FP8 checks, which layers train in FP8;
- `tensor.py`: `Fp8Tensor`, FP8 bytes with their scale;
- `quantize.py`: the quantisers;
- `gemm.py`: `fp8_mm`, the FP8 GEMM with Hopper's rules checked on every device;
- `scaling.py`: delayed scaling's amax histories and scales;
- `weights.py`: the FP8 copies of the weights;
- `linear.py`: the FP8 linear layers.
"""
