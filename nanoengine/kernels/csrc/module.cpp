// nanoengine's CPU kernels (chapter 06): the Python module. One extension built from every csrc/*.cpp by
// nanoengine/kernels/cpu.py; this file only binds what the family files define (declared in kernels.h).
// Every kernel lets go of the GIL while it computes (they touch no Python object), so a decode step on the
// engine's forward thread runs beside the host's Python (overlap scheduling, chapter 06).
#include <torch/extension.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace nanoengine;
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("paged_decode", &paged_decode, "paged decode attention on CPU (reads K/V in place; a bf16 cache under float32 q)",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_tables"),
        pybind11::arg("context_lens"), pybind11::arg("scale"), pybind11::arg("path") = "auto", nogil);
  m.def("rms_norm", &rms_norm, "(residual +) RMSNorm: returns [normed] or [normed, residual sum]", nogil);
  m.def("rotary", &rotary, "rotary embedding of [T, heads, D] rows (a copy)", nogil);
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up", nogil);
  m.def("bf16_pack", &bf16_pack, "lay a weight out for bf16_linear (bf16 blocks of 8 rows, column-major in a block)", nogil);
  m.def("bf16_linear", &bf16_linear, "x @ W^T (+ bias) with a bf16_pack-ed weight, float32 sums (small batches)", nogil);
  m.def("int8_pack", &int8_pack, "lay an int8 weight and its scales out for int8_linear (blocks of 16 rows)", nogil);
  m.def("int8_linear", &int8_linear, "x @ (q * s)^T (+ bias) with int8_pack-ed int8 weights, float32 sums (small batches)",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("scales"), pybind11::arg("bias"), pybind11::arg("N"),
        pybind11::arg("group_size"), pybind11::arg("path") = "auto", nogil);
  pybind11::class_<Linear>(m, "Linear")
      .def(pybind11::init([](c10::optional<at::Tensor> packed, at::Tensor weight, c10::optional<at::Tensor> bias,
                             int64_t out_features, c10::optional<at::Tensor> int8,
                             c10::optional<at::Tensor> int8_scales, int64_t group_size) {
             return Linear{packed, weight, bias, out_features, int8, int8_scales, group_size};
           }),
           pybind11::arg("packed"), pybind11::arg("weight"), pybind11::arg("bias"), pybind11::arg("out_features"),
           pybind11::arg("int8") = c10::nullopt, pybind11::arg("int8_scales") = c10::nullopt,
           pybind11::arg("group_size") = 0);
  pybind11::class_<DecodeLayer>(m, "DecodeLayer")
      .def(pybind11::init<at::Tensor, at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>, Linear,
                          Linear, Linear, Linear, at::Tensor, at::Tensor>(),
           pybind11::arg("input_norm"), pybind11::arg("post_norm"), pybind11::arg("q_norm"), pybind11::arg("k_norm"),
           pybind11::arg("qkv"), pybind11::arg("o"), pybind11::arg("gate_up"), pybind11::arg("down"),
           pybind11::arg("k_cache"), pybind11::arg("v_cache"));
  m.def("decode_layers", &decode_layers, "a decode step's decoder layers in one call (the same kernels, in order)", nogil);
}
