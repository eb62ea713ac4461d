"""``lowmem-hf load --compare-transformers``'s arithmetic: round order, medians, wins, multiples of bare."""

from lowmem_hf.comparison import comparison_lines, round_order, summarize


def _run(loader: str, seconds: float, anon: int = 100, hwm: int = 100) -> dict:
    return {"loader": loader, "seconds": seconds, "peak_rss_anon_bytes": anon, "peak_vm_hwm_bytes": hwm}


def test_no_loader_always_runs_first():
    loaders = ["lowmem", "transformers", "bare"]
    assert round_order(loaders, 0) == loaders
    assert round_order(loaders, 1) == ["bare", "transformers", "lowmem"]
    assert round_order(loaders, 2) == loaders


def test_a_loader_is_judged_by_its_median_and_its_worst_memory_peak():
    runs = [_run("lowmem", 1.0, anon=90), _run("transformers", 2.0), _run("lowmem", 5.0, anon=120), _run("lowmem", 2.0)]
    ours, theirs = summarize(runs)
    assert ours["loader"] == "lowmem" and ours["seconds"] == 2.0 and ours["runs_seconds"] == [1.0, 5.0, 2.0]
    assert ours["peak_rss_anon_bytes"] == 120  # the highest peak of its runs, not the median's
    assert theirs["seconds"] == 2.0 and theirs["runs_seconds"] == [2.0]


def test_the_ratio_line_says_medians_rounds_won_and_distance_to_bare():
    runs = [_run("lowmem", 1.0), _run("transformers", 2.0), _run("bare", 0.5),
            _run("bare", 0.5), _run("transformers", 1.0), _run("lowmem", 1.5, hwm=50)]
    ratio, floor = comparison_lines(summarize(runs))
    assert ratio.startswith("lowmem_hf / transformers: time 0.83x (medians of 2, alternating; lowmem_hf faster in 1 of 2)")
    assert "VmHWM 1.00x" in ratio  # the worst of lowmem_hf's runs (100) against transformers' (100)
    assert floor.endswith("lowmem_hf 2.50x, transformers 3.00x")


def test_without_transformers_there_is_no_ratio_line():
    assert comparison_lines(summarize([_run("lowmem", 1.0)])) == []
