"""The bottom layer: what every other layer may use and that uses nothing of ftjax's.

Addresses (`net`), the process environment and the job token (`env`), child processes that die
with their owner (`procs`), and the constant global batch's row arithmetic (`batches`). No JAX,
no gRPC (docs/design/index.md, "Package layers").
"""
