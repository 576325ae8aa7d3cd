"""The padding that lets one CUDA Graph per bucket length run every GDN prefill chunk
(ninfer_core.accel.fla_glue.padded_gdn_core): rows past the chunk get g = 0 and beta = 0, and
whatever they hold, the real rows' outputs and the final state equal the unpadded chunk's. Here
the graph body runs on the CPU with core's torch chunk rule (ninfer_core.nn.gdn) in fla's place."""

import torch

from ninfer_core.accel.fla_glue import GRAPH_BUCKETS, graph_bucket, padded_gdn_core
from ninfer_core.nn import gdn as ref_gdn

HK, HV, DK, DV = 2, 4, 16, 8


def ref_fla(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
    """fla's chunk_gated_delta_rule signature over the torch reference (batch of one)."""
    assert output_final_state and use_qk_l2norm_in_kernel
    rep = HV // HK
    q = ref_gdn.l2norm(q[0].float().repeat_interleave(rep, dim=1)) * scale
    k = ref_gdn.l2norm(k[0].float().repeat_interleave(rep, dim=1))
    o, s = ref_gdn.chunk_gated_delta_rule(q, k, v[0].float(), g[0], beta[0].float(), initial_state[0], chunk=16)
    return o[None], s[None]


def _chunk(t, gen):
    cd = 2 * HK * DK + HV * DV
    return torch.randn(t, cd + 2 * HV, generator=gen)


def test_padding_rows_change_nothing():
    gen = torch.Generator().manual_seed(3)
    A = torch.rand(HV, generator=gen) * 2
    dtb = torch.randn(HV, generator=gen)
    h0 = torch.randn(1, HV, DK, DV, generator=gen) * 0.1
    for t, tp in ((5, 16), (16, 48), (21, 64), (40, 40)):
        real = _chunk(t, gen)
        padded = torch.cat([real, _chunk(tp - t, gen) * 3])  # stale, nonzero rows past the chunk
        o_ref, s_ref = padded_gdn_core(ref_fla, real, torch.tensor(t), A, dtb, h0, (HK, HV, DK, DV), DK**-0.5)
        o, s = padded_gdn_core(ref_fla, padded, torch.tensor(t), A, dtb, h0, (HK, HV, DK, DV), DK**-0.5)
        assert o.shape[1] == tp
        torch.testing.assert_close(o[:, :t], o_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=1e-5)
        if t < tp:  # the padding really was live data: without the mask the state moves
            s_bad = padded_gdn_core(ref_fla, padded, torch.tensor(tp), A, dtb, h0, (HK, HV, DK, DV), DK**-0.5)[1]
            assert not torch.allclose(s_bad, s_ref, atol=1e-3)


def test_bucket_choice():
    assert graph_bucket(1) == GRAPH_BUCKETS[0]
    assert graph_bucket(129) == 256 and graph_bucket(256) == 256 and graph_bucket(300) == 384
    assert graph_bucket(GRAPH_BUCKETS[-1]) == GRAPH_BUCKETS[-1]
    assert graph_bucket(GRAPH_BUCKETS[-1] + 1) is None
