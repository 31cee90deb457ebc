"""`python -m kvserve.bench.int8_routes`: every available route in both tables, as ratios to oneDNN's call."""
from kvserve.bench import int8_routes
from kvserve.model.int8_kernels import OneDNNKernel


def test_the_bench_prints_every_route_at_every_row_count_and_shape(capsys, monkeypatch):
    monkeypatch.setattr(int8_routes, "LAYER_SHAPES", ((24, 16), (16, 32)))
    monkeypatch.setattr(int8_routes, "HEAD_SHAPE", (40, 16))
    int8_routes.main(["--layers", "2", "--rounds", "1", "--reps", "1"])
    out = capsys.readouterr().out
    routes = int8_routes.routes()
    reference = OneDNNKernel().name if OneDNNKernel().available() else routes[0].name
    assert f"reference: {reference}" in out
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert [int(row[0]) for row in rows] == list(int8_routes.ROWS)
    assert all(len(row) == len(routes) + 1 and all(r.endswith("x") for r in row[2:]) for row in rows)
    for shape in ("24x16", "16x32", "40x16"):
        assert shape in out
