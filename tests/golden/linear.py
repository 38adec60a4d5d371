# triton_tem_fused_mm_0: computes matmul, add, relu
@triton_heuristics.template(size_hints={'b': 1, 'm': 64, 'n': 256, 'k': 128}, meta={'itemsize': 4, 'tuning_key': 'mm float32 out=(64, 256) a=(128, 1)+0 b=(1, 128)+0 k=128 split=1 ieee'}, signature={'in_ptr0': '*fp32', 'in_ptr1': '*fp32', 'in_ptr2': '*fp32', 'out_ptr0': '*fp32', 'bnumel': 'i32', 'mnumel': 'i32', 'nnumel': 'i32', 'knumel': 'i32'})
@triton.jit
def triton_tem_fused_mm_0(in_ptr0, in_ptr1, in_ptr2, out_ptr0, bnumel, mnumel, nnumel, knumel, BLOCK_M : tl.constexpr, BLOCK_N : tl.constexpr, BLOCK_K : tl.constexpr, GROUP_M : tl.constexpr):
    M = 64
    N = 256
    K = 128
    # Prop. 9.4: programs numbered in groups of GROUP_M row blocks, so that the programs running at
    # one time share the row blocks of A and the column blocks of B in L2
    pid = tl.program_id(0)
    grid_m = (M + BLOCK_M - 1) // BLOCK_M
    grid_n = (N + BLOCK_N - 1) // BLOCK_N
    width = GROUP_M * grid_n
    group_id = pid // width
    group_size = min(grid_m - group_id * GROUP_M, GROUP_M)
    pid_m = group_id * GROUP_M + (pid % group_size)
    pid_n = (pid % width) // group_size
    bid = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N))
    rk = tl.arange(0, BLOCK_K)
    A = in_ptr0 + (rm[:, None] * 128 + rk[None, :])
    B = in_ptr1 + (rk[:, None] + rn[None, :] * 128)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(A, mask=(rm[:, None] < M) & (rk[None, :] < K - k), other=0.0)
        b = tl.load(B, mask=(rk[:, None] < K - k) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision="ieee", out_dtype=tl.float32)
        A += BLOCK_K
        B += BLOCK_K
    xmask = (rm[:, None] < M) & (rn[None, :] < N)
    x0 = rm[:, None]
    x1 = rn[None, :]
    tmp0 = tl.load(in_ptr2 + (x1), xmask)
    tmp1 = (acc + tmp0)
    tmp2 = tl.full([1, 1], 0, tl.int32)
    tmp3 = tl.maximum(tmp2, tmp1, tl.PropagateNan.ALL)
    tl.store(out_ptr0 + (256*x0 + x1), tmp3, xmask)
