"""FP8 training on PyTorch's own primitives (`torch._scaled_mm`, `torch._scaled_grouped_mm`,
`torch.float8_e4m3fn` / `float8_e5m2`): Megatron-LM's FP8 recipes for the linear layers of
transformer layers and the experts of MoE layers.

- `recipe.py`: formats, recipes, the config's FP8 checks, which layers train in FP8;
- `tensor.py`: `Fp8Tensor`, FP8 bytes with their scale, and `BlockFp8Tensor`, with their block
  scales;
- `quantize.py`: the per-tensor quantisers; `kernels.py`: their CUDA kernels;
- `blockwise.py`: the blockwise recipe's quantisers (1x128 / 128x128 blocks);
  `block_kernels.py`: their CUDA kernels;
- `gemm.py`: `fp8_mm`, the FP8 GEMM with Hopper's rules checked on every device;
- `scaling.py`: delayed scaling's amax histories and scales;
- `weights.py`: the FP8 copies of the weights (stacked expert weights: one scale per expert);
- `linear.py`: the FP8 linear layers;
- `grouped_gemm.py`: the experts' grouped FP8 GEMMs (`torch._scaled_grouped_mm`);
- `experts.py`: the FP8 experts of MoE layers.
"""
