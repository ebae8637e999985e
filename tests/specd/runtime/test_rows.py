"""The few-row CPU product (specd.runtime.rows): equal to torch's within float32 rounding for any
row count and shape, and a row's result independent of the rows that came with it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specd.runtime import rows

# Sizes that exercise every path: whole vector blocks and a tail (K), whole four-output blocks
# and a partial one (N), row groups of 4, 2 and 1, and the tiled fallback beyond 48 rows.
SHAPES = [(576, 192), (70, 13), (16, 4), (5, 3)]
ROW_COUNTS = [1, 2, 3, 4, 5, 7, 8, 17, 33, 48, 49, 64]


@pytest.fixture(scope="module")
def product(tmp_path_factory):
    reason = rows.load(tmp_path_factory.mktemp("ops"))
    if reason is not None:
        pytest.skip(f"the operator cannot be built here: {reason}")
    return torch.ops.specd.rows_linear


@pytest.mark.parametrize("k,n", SHAPES)
def test_equals_torch_product_for_every_row_count(product, k, n):
    gen = torch.Generator().manual_seed(k * n)
    w = torch.randn(n, k, generator=gen)
    for m in ROW_COUNTS:
        x = torch.randn(2, m, k, generator=gen)  # a batch of windows: [B, T, K]
        out = product(x, w)
        assert out.shape == (2, m, n)
        torch.testing.assert_close(out, F.linear(x, w), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("k,n", SHAPES)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(product, k, n):
    """A verification window's products equal the decoding steps' bit for bit (up to 48 rows)."""
    gen = torch.Generator().manual_seed(k + n)
    w, x = torch.randn(n, k, generator=gen), torch.randn(48, k, generator=gen)
    alone = torch.cat([product(x[i:i + 1], w) for i in range(48)])
    for m in (2, 3, 4, 5, 8, 17, 48):
        assert torch.equal(product(x[:m], w), alone[:m]), m


def test_takes_strided_inputs_and_refuses_other_dtypes(product):
    w = torch.randn(24, 32)
    x = torch.randn(32, 6).t()  # not contiguous
    torch.testing.assert_close(product(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(product(x, w.t().contiguous().t()), F.linear(x, w), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="float32"):
        product(x.double(), w.double())


def test_linear_uses_the_operator_only_where_it_fits(product):
    w, x = torch.randn(8, 16), torch.randn(3, 16)
    assert torch.equal(rows.linear(x, w), product(x, w))
    torch.testing.assert_close(rows.linear(x.double(), w.double()), F.linear(x.double(), w.double()))
    with rows.disabled():
        assert not rows.loaded()
        assert torch.equal(rows.linear(x, w), F.linear(x, w))
    assert rows.loaded()


def test_its_vectors_are_as_wide_as_the_machines_registers(product):
    """A vector wider than the registers (16 floats on an AVX2-only CPU) is split by the compiler
    and made a 9-row window cost 5x a step there (docs/bench/kernels-avx2-epyc)."""
    flags = set(rows._cpu_flags().split())
    if "avx512f" in flags:
        assert torch.ops.specd.rows_lanes() == 16
    elif "avx" in flags:
        assert torch.ops.specd.rows_lanes() == 8
    else:
        pytest.skip("no AVX: the vector width is not checked on this CPU")


def test_several_weights_in_one_pass_equal_their_products_side_by_side(product):
    """q/k/v (or gate/up) in one call: bit for bit the separate products concatenated, for every
    row count, with weights whose rows end in a partial block of four."""
    gen = torch.Generator().manual_seed(7)
    ws = [torch.randn(n, 70, generator=gen) for n in (13, 8, 3, 21)]
    for m in ROW_COUNTS:
        x = torch.randn(2, m, 70, generator=gen)
        out = torch.ops.specd.rows_linear_cat(x, ws)
        assert torch.equal(out, torch.cat([product(x, w) for w in ws], dim=-1)), m
    assert torch.equal(rows.linear_cat(x, ws), out)
    with rows.disabled():
        torch.testing.assert_close(rows.linear_cat(x, ws), out, atol=1e-4, rtol=1e-5)
    with pytest.raises(RuntimeError, match="shapes"):
        torch.ops.specd.rows_linear_cat(x, [ws[0], torch.randn(4, 69)])


@pytest.mark.parametrize("dim", [64, 70])
def test_pool_attention_equals_sdpa_over_the_gathered_keys_and_a_row_is_its_own(product, dim):
    """rows_attention reads each row's slot of the pool in place, each query the keys up to its
    position: SDPA's result over the gathered keys within float32 rounding, padded queries (position
    0) included, and a query's result the same bits alone or in any batch."""
    gen = torch.Generator().manual_seed(dim)
    slots, kv_heads, groups, columns, width = 5, 3, 3, 43, 6
    k, v = torch.randn(slots, kv_heads, columns, dim, generator=gen), torch.randn(slots, kv_heads, columns, dim, generator=gen)
    q = torch.randn(3, kv_heads * groups, width, dim, generator=gen)
    rows_slots = torch.tensor([4, 1, 2])
    qpos = torch.tensor([[20, 21, 22, 23, 24, 25], [5, 6, 7, 8, 0, 0], [42, 0, 0, 0, 0, 0]])  # padded queries: 0; 42: the last column
    out = torch.ops.specd.rows_attention(q, k, v, rows_slots, qpos, 0.125)
    mask = (torch.arange(columns) <= qpos[:, :, None])[:, None]
    expected = F.scaled_dot_product_attention(q, k.index_select(0, rows_slots), v.index_select(0, rows_slots),
                                              attn_mask=mask, scale=0.125, enable_gqa=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for b, t in ((1, 1), (0, 5), (2, 0)):  # a query alone: its bits in any batch and block of positions
        alone = torch.ops.specd.rows_attention(q[b:b + 1, :, t:t + 1], k, v, rows_slots[b:b + 1],
                                               qpos[b:b + 1, t:t + 1], 0.125)
        assert torch.equal(alone, out[b:b + 1, :, t:t + 1]), (b, t)
    strided_q = q.transpose(1, 2).contiguous().transpose(1, 2)  # as a forward's rotated queries come
    assert torch.equal(rows.attention(strided_q, k, v, rows_slots, qpos, 0.125), out)
    assert rows.attends(torch.float32, torch.device("cpu")) and not rows.attends(torch.float64, torch.device("cpu"))
    with rows.disabled():
        assert not rows.attends(torch.float32, torch.device("cpu"))
