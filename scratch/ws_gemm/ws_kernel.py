"""Scratch kernels."""
import triton
import triton.language as tl


@triton.jit
def _pid(tile_id, num_pid_in_group, num_pid_m, GROUP_M: tl.constexpr):
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def gemm_i8(a_ptr, b_ptr, c_ptr, s_ptr, bias_ptr, alpha, M, N, K,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
            NUM_SMS: tl.constexpr, WS: tl.constexpr, SUB: tl.constexpr, FLAT: tl.constexpr):
    start_pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    num_tiles = num_pid_m * num_pid_n
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    if SUB:
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN // 2])
    else:
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    num_pid_in_group = GROUP_M * num_pid_n
    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=FLAT, warp_specialize=WS):
        pid_m, pid_n = _pid(tile_id, num_pid_in_group, num_pid_m, GROUP_M)
        offs_am = pid_m * BM
        offs_bn = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.int32)
        for ki in range(k_tiles):
            offs_k = ki * BK
            a = a_desc.load([offs_am, offs_k])
            b = b_desc.load([offs_bn, offs_k])
            acc = tl.dot(a, b.T, acc, out_dtype=tl.int32)
        if SUB:
            acc3 = tl.reshape(acc, (BM, 2, BN // 2))
            acc3 = tl.permute(acc3, (0, 2, 1))
            acc0, acc1 = tl.split(acc3)
            offs0 = offs_bn + tl.arange(0, BN // 2)
            s0 = tl.load(s_ptr + offs0) * alpha
            b0 = tl.load(bias_ptr + offs0)
            y0 = acc0.to(tl.float32) * s0[None, :] + b0[None, :]
            c_desc.store([offs_am, offs_bn], y0.to(tl.float16))
            offs1 = offs_bn + BN // 2 + tl.arange(0, BN // 2)
            s1 = tl.load(s_ptr + offs1) * alpha
            b1 = tl.load(bias_ptr + offs1)
            y1 = acc1.to(tl.float32) * s1[None, :] + b1[None, :]
            c_desc.store([offs_am, offs_bn + BN // 2], y1.to(tl.float16))
        else:
            offs = offs_bn + tl.arange(0, BN)
            s = tl.load(s_ptr + offs) * alpha
            bb = tl.load(bias_ptr + offs)
            y = acc.to(tl.float32) * s[None, :] + bb[None, :]
            c_desc.store([offs_am, offs_bn], y.to(tl.float16))




@triton.jit
def gemm_i8_np(a_ptr, b_ptr, c_ptr, s_ptr, bias_ptr, alpha, M, N, K,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
               NUM_SMS: tl.constexpr, WS: tl.constexpr, SUB: tl.constexpr, FLAT: tl.constexpr):
    """One program a tile; warp specialization on the K loop."""
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    pid_m, pid_n = _pid(tl.program_id(0), GROUP_M * num_pid_n, num_pid_m, GROUP_M)
    offs_am = pid_m * BM
    offs_bn = pid_n * BN
    acc = tl.zeros((BM, BN), dtype=tl.int32)
    for ki in tl.range(k_tiles, warp_specialize=WS):
        offs_k = ki * BK
        a = a_desc.load([offs_am, offs_k])
        b = b_desc.load([offs_bn, offs_k])
        acc = tl.dot(a, b.T, acc, out_dtype=tl.int32)
    offs = offs_bn + tl.arange(0, BN)
    s = tl.load(s_ptr + offs) * alpha
    bb = tl.load(bias_ptr + offs)
    y = acc.to(tl.float32) * s[None, :] + bb[None, :]
    c_desc.store([offs_am, offs_bn], y.to(tl.float16))
