"""RULER-lite's summary: a (length, task) the reference fails is left out of every setting's average, and a setting
is compared with the reference over the same pairs."""
from kvserve.eval.ruler_run import PASS_THRESHOLD, RulerScores, excluded_pairs, included_pairs

REFERENCE = RulerScores({2048: {"niah_single": 1.0, "vt": 0.2}, 4096: {"niah_single": 0.9, "vt": PASS_THRESHOLD}})
TESTED = RulerScores({2048: {"niah_single": 0.5, "vt": 0.0}, 4096: {"niah_single": 0.45, "vt": 0.3}})


def test_pairs_the_reference_fails_are_left_out_of_the_average():
    assert included_pairs(REFERENCE) == [(2048, "niah_single"), (4096, "niah_single"), (4096, "vt")]
    assert excluded_pairs(REFERENCE) == [(2048, "vt")]
    included = included_pairs(REFERENCE)
    assert abs(REFERENCE.average(included) - (1.0 + 0.9 + 0.6) / 3) < 1e-12
    assert abs(TESTED.average(included) - (0.5 + 0.45 + 0.3) / 3) < 1e-12


def test_a_setting_missing_a_length_has_no_average():
    short = RulerScores({2048: {"niah_single": 1.0, "vt": 0.0}}, why={4096: "n/a: longer than max_model_len"})
    assert short.average(included_pairs(REFERENCE)) is None
    assert short.to_json() == {"2048": {"niah_single": 1.0, "vt": 0.0}}


def test_tables_bracket_what_the_reference_fails_and_compare_averages(capsys):
    from kvserve.eval.ruler_run import RulerPlan, print_ruler_tables

    plan = RulerPlan(["niah_single", "vt"], [2048, 4096], samples=2, seed=0)
    print_ruler_tables(["full cache", "tested"], [REFERENCE, TESTED], plan)
    out = capsys.readouterr().out
    assert "RULER-lite, 2,048-token prompts" in out and "RULER-lite over all lengths" in out
    assert "(20%)" in out and "(0%)" in out  # vt at 2,048 for both settings: the reference fails it
    assert "83.3%" in out and "41.7%" in out and "50.0%" in out  # averages and tested / reference
    assert "vt at 2,048" in out.splitlines()[-1]
