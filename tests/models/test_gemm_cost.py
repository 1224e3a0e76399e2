"""models/gemm_cost.py: the work counts, a valid table, and the choice as a pure
function of the shape (the cheapest at the table's prices)."""

import pytest

from jaxinfer.models import gemm_cost


def test_work():
    assert gemm_cost.TILE_ROWS == 16
    assert gemm_cost.work("plain", gemm_cost.GemmShape(rows=2, n=40, k=96, weight_itemsize=2)) == dict(
        calls=1, weight_bytes=40 * 96 * 2, in_bytes=2 * 96 * 2, flops=2 * 2 * 40 * 96, tile_flops=2 * 16 * 40 * 96,
        out_bytes=4 * 2 * 40)
    batched = gemm_cost.work("transposed", gemm_cost.GemmShape(17, 40, 96, 4, batch=3))
    assert batched == dict(calls=1, weight_bytes=3 * 40 * 96 * 4, in_bytes=3 * 17 * 96 * 4, flops=2 * 3 * 17 * 40 * 96,
                           tile_flops=2 * 3 * 32 * 40 * 96, out_bytes=4 * 3 * 17 * 40)
    with pytest.raises(ValueError, match="matvec"):
        gemm_cost.work("matvec", gemm_cost.GemmShape(2, 40, 96))


def test_table_covers_every_form_and_feature():
    table = gemm_cost._table()["cpu"]
    for dtype in ("float32", "bfloat16"):
        assert table[dtype]["source"].startswith("measured")
        assert set(table[dtype]["forms"]) == set(gemm_cost.FORMS), dtype
        for form, price in table[dtype]["forms"].items():
            assert set(price) == set(gemm_cost.FEATURES) and min(price.values()) >= 0, (dtype, form)
    assert gemm_cost.coefficients("int8") == table["float32"]["forms"]  # other weight dtypes: float32's prices


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_choice_is_the_cheapest_and_a_pure_function_of_the_shape(dtype):
    for rows in (2, 16, 64, 128, 1024):
        for n, k, batch in ((8192, 512, 0), (1408, 2048, 0), (256, 512, 16), (32, 64, 8)):
            shape = gemm_cost.GemmShape(rows, n, k, 2 if dtype == "bfloat16" else 4, batch)
            first = gemm_cost.choose(shape, dtype)
            gemm_cost.choose.cache_clear()
            assert gemm_cost.choose(shape, dtype) == first and first in gemm_cost.forms(shape)
            assert first == "plain" or rows <= gemm_cost.MAX_TRANSPOSED_ROWS
            prices = gemm_cost.coefficients(dtype)
            costs = {f: gemm_cost.price(f, shape, prices) for f in gemm_cost.forms(shape)}
            assert costs[first] == min(costs.values())
