# triton_tem_fused_attention_0: computes sdpa_matmul_1 (flash attention, §9.10)
@triton_heuristics.attention(size_hints={'b': 8, 'm': 256, 'n': 256, 'd': 64, 'sq': 0, 'skv': 0}, signature={'in_ptr0': '*bf16', 'in_ptr1': '*bf16', 'in_ptr2': '*bf16', 'out_ptr0': '*bf16', 'out_ptr1': '*fp32', 'bnumel': 'i32', 'mnumel': 'i32', 'nnumel': 'i32', 'dnumel': 'i32', 'sqnumel': 'i32', 'skvnumel': 'i32'})
@triton.jit
def triton_tem_fused_attention_0(in_ptr0, in_ptr1, in_ptr2, out_ptr0, out_ptr1, bnumel, mnumel, nnumel, dnumel, sqnumel, skvnumel, BLOCK_M : tl.constexpr, BLOCK_N : tl.constexpr):
    M = 256
    N = 256
    D = 64
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // 4
    h = bh % 4
    hk = h
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    rd = tl.arange(0, 64)
    q = tl.load(in_ptr0 + (b * 65536 + h * 16384 + rm[:, None] * 64 + rd[None, :]))
    # the online triple of each query row: running max (base 2), sum, and output
    m_i = tl.full([BLOCK_M], -3.4028234663852886e+38, tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, 64], dtype=tl.float32)
    # the blocks left of the diagonal: no causal mask
    diagonal = (pid_m * BLOCK_M) // BLOCK_N * BLOCK_N
    for start_n in range(0, diagonal, BLOCK_N):
        rn = start_n + tl.arange(0, BLOCK_N)
        kT = tl.load(in_ptr1 + (b * 65536 + hk * 16384 + rn[None, :] * 64 + rd[:, None]))
        qk = tl.dot(q, kT, out_dtype=tl.float32)
        # the online update: rescale (l, acc) by 2^(m_old - m_new), then add this block (the scale folded into exp2's argument)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * 0.36067376022224085)
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk * 0.36067376022224085 - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vb = tl.load(in_ptr2 + (b * 65536 + hk * 16384 + rn[:, None] * 64 + rd[None, :]))
        acc = tl.dot(p.to(tl.bfloat16), vb, acc * alpha[:, None], out_dtype=tl.float32)
        m_i = m_new
    # the diagonal blocks: the causal mask
    for start_n in range(diagonal, tl.minimum(N, (pid_m + 1) * BLOCK_M), BLOCK_N):
        rn = start_n + tl.arange(0, BLOCK_N)
        kT = tl.load(in_ptr1 + (b * 65536 + hk * 16384 + rn[None, :] * 64 + rd[:, None]))
        qk = tl.dot(q, kT, out_dtype=tl.float32)
        qk = tl.where((rm[:, None] >= rn[None, :]), qk, float("-inf"))
        # the online update: rescale (l, acc) by 2^(m_old - m_new), then add this block (the scale folded into exp2's argument)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * 0.36067376022224085)
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk * 0.36067376022224085 - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vb = tl.load(in_ptr2 + (b * 65536 + hk * 16384 + rn[:, None] * 64 + rd[None, :]))
        acc = tl.dot(p.to(tl.bfloat16), vb, acc * alpha[:, None], out_dtype=tl.float32)
        m_i = m_new
    # o = a / l (a row that saw no key gives NaN, as softmax), LSE = (m + log2 l) * ln 2
    o = acc / l_i[:, None]
    tl.store(out_ptr0 + (b * 65536 + h * 16384 + rm[:, None] * 64 + rd[None, :]), o.to(tl.bfloat16))
    tl.store(out_ptr1 + (bh * M + rm), (m_i + tl.math.log2(l_i)) * 0.6931471805599453)


def call(args):
    arg0_1, arg1_1, arg2_1 = args
    args.clear()
    assert_size_stride(arg0_1, (2, 4, 256, 64), (65536, 16384, 64, 1), 'input')
    assert_size_stride(arg1_1, (2, 4, 256, 64), (65536, 16384, 64, 1), 'input')
    assert_size_stride(arg2_1, (2, 4, 256, 64), (65536, 16384, 64, 1), 'input')
    with stax.cuda.device(0):
        buf0 = empty_strided_cuda((2, 4, 256, 64), (65536, 16384, 64, 1), stax.bfloat16)
        buf0_lse = empty_strided_cuda((2048,), (1,), stax.float32)
        raw_stream0 = get_raw_stream(0)
        triton_tem_fused_attention_0.run(arg0_1, arg1_1, arg2_1, buf0, buf0_lse, 8, 256, 256, 64, 0, 0, stream=raw_stream0)
        del buf0_lse
        del arg0_1, arg1_1, arg2_1
    return (buf0, )
