from mcp2026.quant.method_errors import ratio_line


def test_ratio_line_gives_the_median_and_range_of_the_ratios():
    assert ratio_line([(1.0, 4.0), (1.0, 2.0), (3.0, 4.0)]) == "median 0.500x (from 0.250x to 0.750x)"


def test_layers_rounding_reproduces_exactly_are_counted_not_divided():
    # weights on the layout's own grid: round-to-nearest's error is 0, and 0 / 0 is no ratio
    assert ratio_line([(0.0, 0.0), (1.0, 2.0)]) == (
        "median 0.500x (from 0.500x to 0.500x); 1 exact under round-to-nearest (already on the grid)"
    )
    assert ratio_line([(0.0, 0.0)] * 3) == "3 exact under round-to-nearest (already on the grid)"
