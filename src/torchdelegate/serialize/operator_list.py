"""The operators a saved graph may call: an explicit list, read by ``allow_list``.

A residual graph (what a file runs on torch itself, outside its delegates) holds what lowering
leaves: core ATen after ``to_edge``'s decompositions, the few ATen operators those decompositions
keep whole (``cumprod``, ``searchsorted``, ...), size arithmetic and our own operators. Each entry
below was reviewed for what its kernel does with caller-given arguments: nothing here touches a
storage or the allocator (``resize_``, ``set_``, ``_reshape_alias``, ``from_file``), writes into an
``out=`` argument, runs a backward kernel (indices taken on trust) or packs opaque handles. The few
kept whose kernels trust their arguments run behind a contract checked first
(``operator_contracts``). Operators of torch's other namespaces (``inductor``, ``prims``, ...)
are refused; a namespace torch does not own is an extension library the caller imported, whose
operators the caller chose to trust.

Entries are ``name.overload`` of ``torch.ops.aten``.
"""

from __future__ import annotations

ATEN_OPERATORS: frozenset[str] = frozenset(
    {
        "__lshift__.Scalar", "__lshift__.Tensor", "__rshift__.Scalar", "__rshift__.Tensor",
        "_adaptive_avg_pool2d.default", "_adaptive_avg_pool3d.default", "_aminmax.default", "_aminmax.dim",
        "_assert_async.default", "_assert_async.msg", "_assert_scalar.default", "_cdist_forward.default",
        "_embedding_bag.default", "_fft_c2c.default", "_fft_c2r.default", "_fft_r2c.default",
        "_functional_sym_constrain_range.default", "_functional_sym_constrain_range_for_size.default",
        "_linalg_det.default", "_linalg_eigh.default", "_linalg_slogdet.default", "_linalg_solve_ex.default",
        "_linalg_svd.default", "_local_scalar_dense.default", "_log_softmax.default", "_logcumsumexp.default",
        "_native_batch_norm_legit.default", "_native_batch_norm_legit.no_stats",
        "_native_batch_norm_legit_functional.default", "_native_batch_norm_legit_no_training.default",
        "_pdist_forward.default", "_safe_softmax.default", "_softmax.default", "_to_copy.default",
        "_trilinear.default", "_unique2.default", "_upsample_bicubic2d_aa.default", "_upsample_bilinear2d_aa.default",
        "abs.default", "acos.default", "acosh.default", "adaptive_avg_pool1d.default", "adaptive_max_pool2d.default",
        "adaptive_max_pool3d.default", "add.Scalar", "add.Tensor", "addbmm.default", "addmm.default", "addmv.default",
        "alias.default", "alias_copy.default", "allclose.default", "amax.default", "amin.default", "angle.default",
        "any.default", "any.dim", "any.dims", "arange.start_step", "argmax.default", "argmin.default",
        "as_strided.default", "asin.default", "asinh.default", "atan.default", "atan2.default", "atanh.default",
        "avg_pool1d.default", "avg_pool2d.default", "avg_pool3d.default", "bartlett_window.default",
        "bartlett_window.periodic", "batch_norm.default", "bincount.default", "bitwise_and.Scalar",
        "bitwise_and.Scalar_Tensor", "bitwise_and.Tensor", "bitwise_left_shift.Scalar_Tensor",
        "bitwise_left_shift.Tensor", "bitwise_left_shift.Tensor_Scalar", "bitwise_not.default", "bitwise_or.Scalar",
        "bitwise_or.Scalar_Tensor", "bitwise_or.Tensor", "bitwise_right_shift.Scalar_Tensor",
        "bitwise_right_shift.Tensor", "bitwise_right_shift.Tensor_Scalar", "bitwise_xor.Scalar",
        "bitwise_xor.Scalar_Tensor", "bitwise_xor.Tensor", "blackman_window.default", "blackman_window.periodic",
        "bmm.default", "bucketize.Scalar", "bucketize.Tensor", "cat.default", "ceil.default", "cholesky.default",
        "cholesky_inverse.default", "cholesky_solve.default", "chunk.default", "clamp.Tensor", "clamp.default",
        "clone.default", "col2im.default", "complex.default", "constant_pad_nd.default", "conv1d.default",
        "conv2d.default", "conv3d.default", "conv_transpose1d.default", "conv_transpose2d.input",
        "convolution.default", "copy.default", "copysign.Scalar", "copysign.Tensor", "cos.default", "cosh.default",
        "cummax.default", "cummin.default", "cumprod.default", "cumsum.default", "detach_copy.default",
        "diagonal.default", "diagonal_scatter.default", "digamma.default", "dist.default", "div.Scalar",
        "div.Scalar_mode", "div.Tensor", "div.Tensor_mode", "dropout.default", "einsum.default", "elu.default",
        "embedding.default", "empty.memory_format", "empty_like.default", "empty_strided.default", "eq.Scalar",
        "eq.Tensor", "equal.default", "erf.default", "erfc.default", "erfinv.default", "exp.default", "exp2.default",
        "expand.default", "expand_copy.default", "expm1.default", "fft_fftfreq.default", "fft_rfftfreq.default",
        "fill.Scalar", "fix.default", "flatten.using_ints", "flip.default", "floor.default", "fmax.default",
        "fmin.default", "fmod.Scalar", "fmod.Tensor", "frexp.Tensor", "full.default", "full_like.default",
        "gather.default", "gcd.default", "ge.Scalar", "ge.Tensor", "gelu.default", "grid_sampler_2d.default",
        "grid_sampler_3d.default", "group_norm.default", "gt.Scalar", "gt.Tensor", "hamming_window.default",
        "hamming_window.periodic", "hamming_window.periodic_alpha", "hamming_window.periodic_alpha_beta",
        "hann_window.default", "hardsigmoid.default", "hardswish.default", "hardtanh.default", "histc.default",
        "hypot.default", "i0.default", "igamma.default", "igammac.default", "index.Tensor", "index_put.default",
        "index_reduce.default", "index_select.default", "instance_norm.default", "isinf.default", "isnan.default",
        "kaiser_window.beta", "kaiser_window.default", "kaiser_window.periodic", "kthvalue.default",
        "layer_norm.default", "lcm.default", "ldexp.Tensor", "le.Scalar", "le.Tensor", "leaky_relu.default",
        "lgamma.default", "lift_fresh_copy.default", "linalg_cholesky_ex.default", "linalg_eig.default",
        "linalg_inv_ex.default", "linalg_lu.default", "linalg_lu_factor_ex.default", "linalg_matrix_exp.default",
        "linalg_pinv.atol_rtol_tensor", "linalg_qr.default", "linalg_solve_triangular.default",
        "linalg_vector_norm.default", "linear.default", "log.default", "log10.default", "log1p.default",
        "log2.default", "log_softmax.int", "logcumsumexp.default", "logical_and.default", "logical_not.default",
        "logical_or.default", "logical_xor.default", "logit.default", "lt.Scalar", "lt.Tensor",
        "masked_scatter.default", "masked_select.default", "matmul.default", "max.default", "max.dim",
        "max_pool2d_with_indices.default", "max_pool3d_with_indices.default", "maximum.default", "mean.default",
        "mean.dim", "median.default", "median.dim", "min.default", "min.dim", "minimum.default", "mish.default",
        "mm.default", "mode.default", "mul.Scalar", "mul.Tensor", "nanmedian.default", "nanmedian.dim",
        "narrow_copy.default", "native_dropout.default", "native_group_norm.default", "native_layer_norm.default",
        "ne.Scalar", "ne.Tensor", "neg.default", "new_empty.default", "nextafter.default", "nonzero.default",
        "nonzero_static.default", "pad.default", "permute.default", "permute_copy.default", "pixel_shuffle.default",
        "pixel_unshuffle.default", "polar.default", "polygamma.default", "pow.Scalar", "pow.Tensor_Scalar",
        "pow.Tensor_Tensor", "prelu.default", "prod.default", "prod.dim_int", "rand.default", "rand_like.default",
        "randint.default", "randint.low", "randn.default", "randn_like.default", "randperm.default", "range.step",
        "reciprocal.default", "reflection_pad1d.default", "reflection_pad2d.default", "reflection_pad3d.default",
        "relu.default", "remainder.Scalar", "remainder.Scalar_Tensor", "remainder.Tensor", "repeat.default",
        "replication_pad2d.default", "replication_pad3d.default", "reshape.default", "round.decimals",
        "round.default", "rrelu_with_noise_functional.default", "rsqrt.default", "scalar_tensor.default",
        "scaled_dot_product_attention.default", "scatter.reduce", "scatter.src", "scatter.value",
        "scatter.value_reduce", "scatter_add.default", "scatter_reduce.two", "searchsorted.Scalar",
        "searchsorted.Tensor", "select.int", "select_copy.int", "select_scatter.default", "sgn.default",
        "sigmoid.default", "sign.default", "signbit.default", "silu.default", "sin.default", "sinh.default",
        "slice.Tensor", "slice_copy.Tensor", "slice_scatter.default", "softmax.int", "sort.default", "sort.stable",
        "special_airy_ai.default", "special_bessel_j0.default", "special_bessel_j1.default",
        "special_bessel_y0.default", "special_bessel_y1.default", "special_erfcx.default", "special_i0e.default",
        "special_i1.default", "special_i1e.default", "special_modified_bessel_i0.default",
        "special_modified_bessel_i1.default", "special_modified_bessel_k0.default",
        "special_modified_bessel_k1.default", "special_ndtri.default", "special_scaled_modified_bessel_k0.default",
        "special_scaled_modified_bessel_k1.default", "special_spherical_bessel_j0.default", "special_zeta.default",
        "special_zeta.other_scalar", "special_zeta.self_scalar", "split.Tensor", "split_copy.Tensor",
        "split_with_sizes.default", "sqrt.default", "squeeze.default", "squeeze.dim", "squeeze.dims",
        "squeeze_copy.dims", "sub.Scalar", "sub.Tensor", "sum.dim_IntList", "sym_constrain_range.default",
        "sym_constrain_range_for_size.default", "sym_is_contiguous.default", "sym_numel.default", "sym_size.int",
        "sym_stride.int", "t.default", "t_copy.default", "tan.default", "tanh.default", "topk.default",
        "transpose.int", "transpose_copy.int", "triangular_solve.default", "tril_indices.default",
        "triu_indices.default", "trunc.default", "unbind.int", "unbind_copy.int", "unflatten.int", "unfold.default",
        "unique_consecutive.default", "unique_dim.default", "unique_dim_consecutive.default", "unsqueeze.default",
        "unsqueeze_copy.default", "upsample_bicubic2d.default", "upsample_bicubic2d.vec",
        "upsample_bilinear2d.default", "upsample_bilinear2d.vec", "upsample_linear1d.vec", "upsample_nearest1d.vec",
        "upsample_nearest2d.default", "upsample_nearest2d.vec", "upsample_nearest3d.vec",
        "upsample_trilinear3d.default", "upsample_trilinear3d.vec", "var.correction", "var.dim",
        "var_mean.correction", "view.default", "view.dtype", "view_as_complex.default",
        "view_as_complex_copy.default", "view_as_real.default", "view_as_real_copy.default", "view_copy.default",
        "view_copy.dtype", "where.self", "xlogy.Tensor",
    }
)  # fmt: skip

OUR_OPERATORS: frozenset[str] = frozenset(
    {"call_delegate.default", "delegate_call.default", "linear_blockwise.default", "embedding_blockwise.default"}
)
"""``torch.ops.torchdelegate``: a delegate call as saved (and its earlier name), quantized products."""

TORCH_NAMESPACES: frozenset[str] = frozenset(
    {
        *("aten", "prims", "prim", "inductor", "inductor_prims", "debugprims", "rngprims", "mkl", "mkldnn"),
        *("mkldnn_prepacked", "onednn", "quantized", "_quantized", "quantization", "quantized_decomposed"),
        *("_c10d_functional", "_c10d_functional_autograd", "c10d", "c10d_functional", "_dtensor", "_native"),
        *("_test", "_inductor_test", "debug_mode_ops", "export", "profiler", "sparse", "static_runtime"),
        *("symm_mem", "fsdp", "streams", "flex_lib", "onnx", "onnx_symbolic", "higher_order", "torchdelegate"),
    }
)
"""Namespaces torch (or this package) registers: an operator there is allowed only when listed."""
