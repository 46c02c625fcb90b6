"""Support code of the benchmark scripts in `tools/`, not scripts themselves: the benchmark GPT and
its flags (`gpt_model`), the same GPT in plain PyTorch with PyTorch's own TP x FSDP2 composition
(`torch_2d_model`), the engines a benchmark times (`engines`), the table and JSON the benchmarks
print (`report`) and the kernel benchmarks' shape flags (`shapes`). `python tools/<script>.py` puts
`tools/` on the path, so the scripts import it as `benchmark_lib`."""
