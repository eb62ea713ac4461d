"""pytest plugin: run transformers' own tests with lowmem_hf's one-line switch on, and count who served each load.

Load it with ``-p switch_plugin`` (its folder on ``PYTHONPATH``). Options (or environment variables):

    --lowmem-switch=on|off     LOWMEM_SWITCH          on (default): lowmem_hf.patch_transformers() at session
                                                      start; off: a plain run, outcomes recorded the same way
    --lowmem-report=PATH       LOWMEM_SWITCH_REPORT   where the JSON summary is written (controller only)

Per test (setup, call and teardown together) it records every ``from_pretrained`` call that entered the switch:

- served: lowmem_hf completed the load; the returned model carries ``lowmem_report`` (what lowmem_hf's own
  tests check), so this cannot be confused with a model transformers built;
- fallback: the call came back with transformers' model (no ``lowmem_report``): the switch handed the call to
  transformers with a ``FallbackWarning`` (``lowmem_hf.patch._fall_back``: an argument lowmem_hf does not
  implement, or a checkpoint of which nothing loads); the argument (or lowmem_hf's error) and reason are recorded;
- raised: an exception left the switch, with its type, message and the stage it came from (lowmem_hf's
  ``make_request`` / ``prepare`` / ``execute``, or transformers' loader after a fallback; such a call is counted
  as a fallback too). Many tests expect the exception;
- unaccounted: none of the above could be told apart (the hooks below no longer see what happens inside the
  switch). A harness fault: the runner fails on any.

Guards against a switch that silently stopped applying: before each test ``lowmem_hf.is_patched()`` must hold
and ``PreTrainedModel.from_pretrained`` / ``AutoModel.from_pretrained`` must be the switch's function, or the
test errors with the reason; the hook points (``lowmem_hf.patch._load_or_fall_back`` and ``_fall_back``,
``lowmem_hf.load.prepare``, ``lowmem_hf.request.make_request``) must exist, or the session refuses to start.

Works with pytest-xdist: each worker attaches its counts to the test reports (``user_properties``), which
xdist sends to the controller, and the controller writes the one summary.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
import traceback

import pytest

_KEY = "lowmem_hf_switch"  # the user_properties entry that carries one phase's records
_MSG_LIMIT = 600

_lock = threading.Lock()
_records: list[dict] = []  # loads of the phase now running (or outside any test), reset at each report
_local = threading.local()  # .frames: the switched calls now in progress on this thread (stack)
_hooked = False
_CONFIG: dict = {}  # the session's config, for pytest_runtest_logreport (which gets none)


def pytest_addoption(parser):
    group = parser.getgroup("lowmem_hf switch")
    group.addoption(
        "--lowmem-switch", choices=("on", "off"), default=os.environ.get("LOWMEM_SWITCH", "on"),
        help="on: route from_pretrained through lowmem_hf (patch_transformers) and count loads; off: plain run",
    )
    group.addoption(
        "--lowmem-report", default=os.environ.get("LOWMEM_SWITCH_REPORT"),
        help="write the per-test JSON summary to this path",
    )


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def _is_controller(config) -> bool:
    """The xdist controller: it runs no test, only collects the workers' reports."""
    return config.pluginmanager.hasplugin("dsession")


def _switch_on(config) -> bool:
    return config.getoption("lowmem_switch") == "on"


# --- counting ---------------------------------------------------------------------------------------------


def _frames() -> list[dict]:
    if not hasattr(_local, "frames"):
        _local.frames = []
    return _local.frames


def _short(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= _MSG_LIMIT else text[: _MSG_LIMIT - 3] + "..."


def _staged(stage: str, fn):
    """Wrap a lowmem_hf step: note the stage on the current switched call, and an UnsupportedArgumentError."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        frames = _frames()
        frame = frames[-1] if frames else None
        if frame is not None:
            frame["stage"] = stage
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if frame is not None:
                from lowmem_hf.errors import UnsupportedArgumentError

                if isinstance(exc, UnsupportedArgumentError):
                    frame["unsupported"] = {"argument": exc.argument, "reason": _short(exc)}
                else:
                    frame["lowmem_error"] = {"stage": stage, "type": type(exc).__name__, "message": _short(exc)}
            raise
        finally:
            if frame is not None and stage == "execute":
                frame["executed"] = True

    wrapper.__lowmem_switch_plugin__ = True
    return wrapper


def _record(entry: dict) -> None:
    with _lock:
        _records.append(entry)


def _counted_load_or_fall_back(original):
    @functools.wraps(original)
    def wrapper(cls, path, model_args, kwargs):
        frame = {"stage": "make_request"}
        _frames().append(frame)
        entry = {"class": getattr(cls, "__name__", repr(cls)), "path": _short(path)}
        started = time.perf_counter()
        try:
            result = original(cls, path, model_args, kwargs)
        except BaseException as exc:
            entry["kind"] = "raised"
            entry["type"] = type(exc).__name__
            entry["message"] = _short(exc)
            if "lowmem_error" in frame and "fell_back" not in frame:
                entry["stage"] = frame["lowmem_error"]["stage"]
            elif "fell_back" in frame:  # handed to transformers, whose loader raised
                entry["stage"] = "transformers (after fallback)"
                entry["fallback"] = _fallback_of(frame)
            else:
                entry["stage"] = frame.get("stage", "?")
            raise
        else:
            model = result[0] if isinstance(result, tuple) else result
            report = getattr(model, "lowmem_report", None)
            if report is not None and frame.get("executed"):
                entry["kind"] = "served"
                entry["bytes_read"] = int(getattr(report, "bytes_read", 0) or 0)
            elif report is None and "fell_back" in frame and not frame.get("executed"):
                entry["kind"] = "fallback"
                entry.update(_fallback_of(frame))
            else:  # the hooks disagree with the result: the plugin no longer sees inside the switch
                entry["kind"] = "unaccounted"
                entry["detail"] = (
                    f"lowmem_report={'yes' if report is not None else 'no'}, execute seen={bool(frame.get('executed'))}, "
                    f"fallback seen={'fell_back' in frame}"
                )
            return result
        finally:
            entry["seconds"] = round(time.perf_counter() - started, 3)
            _frames().pop()
            _record(entry)

    wrapper.__lowmem_switch_plugin__ = True
    return wrapper


def _fallback_of(frame: dict) -> dict:
    """``{argument, reason}`` of a call the switch handed to transformers: the argument lowmem_hf does not implement,
    or the lowmem_hf error the switch answered by falling back (``NothingToLoadError``)."""
    if "unsupported" in frame:
        return {"argument": frame["unsupported"]["argument"], "reason": frame["fell_back"]}
    return {"argument": frame.get("lowmem_error", {}).get("type", "?"), "reason": frame["fell_back"]}


def _noted_fall_back(original):
    @functools.wraps(original)
    def wrapper(cls, path, model_args, kwargs, reason):
        frames = _frames()
        if frames:
            frames[-1]["fell_back"] = _short(reason)
        return original(cls, path, model_args, kwargs, reason)

    wrapper.__lowmem_switch_plugin__ = True
    return wrapper


def _install_hooks() -> None:
    """Wrap the switch's entry point and lowmem_hf's steps; refuse if any hook point is gone."""
    global _hooked
    if _hooked:
        return
    import lowmem_hf.load as load_mod
    import lowmem_hf.patch as patch_mod
    import lowmem_hf.request as request_mod

    missing = [
        f"{mod.__name__}.{name}"
        for mod, name in ((patch_mod, "_load_or_fall_back"), (patch_mod, "_fall_back"), (load_mod, "prepare"),
                          (load_mod, "execute"), (request_mod, "make_request"))
        if not callable(getattr(mod, name, None))
    ]
    if missing:
        raise pytest.UsageError(
            "switch_plugin: lowmem_hf no longer has " + ", ".join(missing) + "; the plugin cannot count loads. "
            "Update tests/upstream/switch_plugin.py to the new entry points."
        )
    # patch._switched_from_pretrained looks _load_or_fall_back up as a module global at each call, and
    # _load_or_fall_back imports make_request / prepare / execute from their modules at each call
    patch_mod._load_or_fall_back = _counted_load_or_fall_back(patch_mod._load_or_fall_back)
    patch_mod._fall_back = _noted_fall_back(patch_mod._fall_back)
    request_mod.make_request = _staged("make_request", request_mod.make_request)
    load_mod.prepare = _staged("prepare", load_mod.prepare)
    load_mod.execute = _staged("execute", load_mod.execute)
    _hooked = True


def _check_patched() -> str | None:
    """Why the switch is not in effect, or None."""
    import lowmem_hf
    import lowmem_hf.patch as patch_mod
    from transformers import AutoModel, PreTrainedModel

    if not lowmem_hf.is_patched():
        return "lowmem_hf.is_patched() is False: the switch is off"
    target = patch_mod._switched_from_pretrained
    for cls in (PreTrainedModel, AutoModel):
        method = cls.__dict__.get("from_pretrained")
        if getattr(method, "__func__", None) is not target:
            return f"{cls.__name__}.from_pretrained is {method!r}, not lowmem_hf's switch"
    if not getattr(patch_mod._load_or_fall_back, "__lowmem_switch_plugin__", False):
        return "lowmem_hf.patch._load_or_fall_back was replaced: the plugin no longer counts loads"
    return None


# --- pytest hooks ------------------------------------------------------------------------------------------


def pytest_configure(config):
    config._lowmem_switch = {"tests": {}}
    _CONFIG["config"] = config


def pytest_sessionstart(session):
    config = session.config
    if not _switch_on(config) or _is_controller(config):
        return
    import lowmem_hf

    _install_hooks()
    lowmem_hf.patch_transformers()
    why = _check_patched()
    if why:
        raise pytest.UsageError(f"switch_plugin: {why}")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if _switch_on(item.config):
        why = _check_patched()
        if why:
            pytest.fail(f"switch_plugin: {why} (before {item.nodeid})", pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not _switch_on(item.config):
        return
    with _lock:
        taken = list(_records)
        _records.clear()
    report.user_properties.append((_KEY, taken))


def _crash_message(report) -> str:
    longrepr = report.longrepr
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return _short(crash.message)
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (file, line, reason)
        return _short(longrepr[2])
    return _short(str(longrepr).strip().splitlines()[-1] if longrepr else "")


def pytest_runtest_logreport(report):
    # on the controller with xdist (reports from the workers), in the one process without
    config = _CONFIG.get("config")
    if config is None or _is_worker(config):
        return
    tests = config._lowmem_switch["tests"]
    test = tests.setdefault(
        report.nodeid, {"outcome": None, "duration": 0.0, "served": 0, "fallbacks": [], "raised": [],
                        "unaccounted": [], "bytes_read": 0, "message": None},
    )
    test["duration"] = round(test["duration"] + (report.duration or 0.0), 3)
    for key, value in report.user_properties:
        if key != _KEY:
            continue
        for entry in value:
            kind = entry.get("kind")
            if kind == "served":
                test["served"] += 1
                test["bytes_read"] += entry.get("bytes_read", 0)
            elif kind == "fallback":
                test["fallbacks"].append({k: entry.get(k) for k in ("class", "path", "argument", "reason")})
            elif kind == "raised":
                test["raised"].append({k: entry[k] for k in ("class", "path", "stage", "type", "message", "fallback")
                                       if k in entry})
                if "fallback" in entry:  # handed to transformers, whose loader raised: a fallback too
                    test["fallbacks"].append({"class": entry.get("class"), "path": entry.get("path"),
                                              **entry["fallback"], "raised": entry.get("type")})
            else:
                test["unaccounted"].append(entry)
    outcome = test["outcome"]
    if hasattr(report, "context") and report.when == "call":  # a unittest subTest (pytest's SubtestReport)
        test["subtests"] = test.get("subtests", 0) + 1
        if report.failed:
            test["outcome"] = "failed"
            test["message"] = f"subtest {report.context.msg or report.context.kwargs}: {_crash_message(report)}"
        return  # a skipped or passed subtest says nothing about the test itself
    if hasattr(report, "wasxfail"):
        test["outcome"] = "xfailed" if report.skipped else "xpassed"
    elif report.failed:
        if report.when == "call":
            test["outcome"] = "failed"
        elif outcome not in ("failed",):
            test["outcome"] = "error"
        test["message"] = f"{report.when}: {_crash_message(report)}"
    elif report.skipped and outcome is None:
        test["outcome"] = "skipped"
        test["message"] = _crash_message(report)
    elif report.when == "call" and report.passed and outcome in (None, "skipped"):
        test["outcome"] = "passed"


def _totals(tests: dict) -> dict:
    outcomes: dict[str, int] = {}
    reasons: dict[str, int] = {}
    raised: dict[str, int] = {}
    for test in tests.values():
        outcomes[test["outcome"] or "unknown"] = outcomes.get(test["outcome"] or "unknown", 0) + 1
        for f in test["fallbacks"]:  # by argument: the message quotes the value (a whole state_dict, say)
            key = str(f.get("argument"))
            reasons[key] = reasons.get(key, 0) + 1
        for r in test["raised"]:
            key = f"{r.get('stage')}: {r.get('type')}"
            raised[key] = raised.get(key, 0) + 1
    return {
        "tests": len(tests),
        "outcomes": dict(sorted(outcomes.items())),
        "served": sum(t["served"] for t in tests.values()),
        "fallbacks": sum(len(t["fallbacks"]) for t in tests.values()),
        "raised": sum(len(t["raised"]) for t in tests.values()),
        "unaccounted": sum(len(t["unaccounted"]) for t in tests.values()),
        "tests_with_served_load": sum(1 for t in tests.values() if t["served"]),
        "fallback_reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1])),
        "raised_by_stage": dict(sorted(raised.items(), key=lambda kv: -kv[1])),
    }


def _summary(config) -> dict:
    import torch
    import transformers

    try:
        import lowmem_hf

        lowmem_version = lowmem_hf.__version__
    except Exception:  # noqa: BLE001  (a summary even when lowmem_hf cannot be imported)
        lowmem_version = None
    tests = config._lowmem_switch["tests"]
    return {
        "switch": config.getoption("lowmem_switch"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "lowmem_hf": lowmem_version,
        "totals": _totals(tests),
        "tests": dict(sorted(tests.items())),
    }


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if _is_worker(config):
        return
    path = config.getoption("lowmem_report")
    if not path:
        return
    try:
        summary = _summary(config)
        summary["exitstatus"] = int(exitstatus)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=1, default=str)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        raise


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _is_worker(config):
        return
    totals = _totals(config._lowmem_switch["tests"])
    tr = terminalreporter
    tr.section(f"lowmem_hf switch: {config.getoption('lowmem_switch')}")
    tr.write_line(f"tests: {totals['tests']}  outcomes: {totals['outcomes']}")
    if _switch_on(config):
        tr.write_line(
            f"loads served by lowmem_hf: {totals['served']} (in {totals['tests_with_served_load']} tests), "
            f"handed to transformers: {totals['fallbacks']}, raised: {totals['raised']}, "
            f"unaccounted: {totals['unaccounted']}"
        )
        for reason, n in totals["fallback_reasons"].items():
            tr.write_line(f"  fallback x{n}: {reason}")
        for stage, n in totals["raised_by_stage"].items():
            tr.write_line(f"  raised x{n}: {stage}")
