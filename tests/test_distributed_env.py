"""The multi-process settings (``MOEJAX_*``) a study reads before anything else: each
malformed one refused in one line naming it, before the runtime or jax's config is touched;
a complete set handed to ``jax.distributed.initialize`` as given."""

import re
import warnings

import jax
import jaxlib
import pytest

from moejax.harness import experiment
from moejax.train import distributed
from moejax.train.distributed import initialize_from_env

BASE = {"MOEJAX_COORDINATOR": "127.0.0.1:1234", "MOEJAX_NUM_PROCESSES": "2",
        "MOEJAX_PROCESS_ID": "1"}
REFUSED = [
    ("MOEJAX_NUM_PROCESSES", "two", "MOEJAX_NUM_PROCESSES='two' must be a whole number >= 1"),
    ("MOEJAX_NUM_PROCESSES", "0", "MOEJAX_NUM_PROCESSES='0' must be a whole number >= 1"),
    ("MOEJAX_PROCESS_ID", "-1", "MOEJAX_PROCESS_ID='-1' must be a whole number >= 0"),
    ("MOEJAX_PROCESS_ID", "2", "MOEJAX_PROCESS_ID=2 must be in [0, MOEJAX_NUM_PROCESSES=2)"),
    ("MOEJAX_LOCAL_DEVICE_IDS", "0,a", "MOEJAX_LOCAL_DEVICE_IDS='0,a' must be device numbers"),
    ("MOEJAX_HEARTBEAT_TIMEOUT", "10s",
     "MOEJAX_HEARTBEAT_TIMEOUT='10s' must be a whole number of seconds >= 1"),
    ("MOEJAX_HEARTBEAT_TIMEOUT", "0",
     "MOEJAX_HEARTBEAT_TIMEOUT='0' must be a whole number of seconds >= 1"),
]


@pytest.fixture()
def set_up(monkeypatch):
    """What initialize_from_env set up: its jax config updates and its runtime calls."""
    calls = []
    monkeypatch.setattr(jaxlib, "__version__", "0.12.0.1")  # keeps its compilation cache
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setattr(jax.config, "update", lambda *a: calls.append(a))
    monkeypatch.setattr(distributed, "_watch_peers", lambda: None)
    return calls


@pytest.mark.parametrize("key,value,message", REFUSED)
def test_a_malformed_setting_is_refused_naming_it_before_anything_is_set_up(
        set_up, key, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        initialize_from_env({**BASE, key: value, "JAX_PLATFORMS": "cpu"})
    assert set_up == []


def test_an_incomplete_set_is_refused_and_none_is_one_process(set_up):
    with pytest.raises(ValueError, match=re.escape(
            "is set but ['MOEJAX_NUM_PROCESSES', 'MOEJAX_PROCESS_ID'] are not")):
        initialize_from_env({"MOEJAX_COORDINATOR": "127.0.0.1:1234"})
    assert initialize_from_env({}) is False
    assert set_up == []


def test_a_complete_set_reaches_the_runtime_as_given(set_up):
    env = {**BASE, "MOEJAX_LOCAL_DEVICE_IDS": "0, 1", "MOEJAX_HEARTBEAT_TIMEOUT": "7",
           "JAX_PLATFORMS": "cpu"}
    assert initialize_from_env(env) is True
    assert set_up == [("jax_cpu_collectives_implementation", "gloo"),
                      ("jax_enable_recoverability", True),
                      {"coordinator_address": "127.0.0.1:1234", "num_processes": 2,
                       "process_id": 1, "local_device_ids": [0, 1],
                       "heartbeat_timeout_seconds": 7}]


@pytest.mark.parametrize("version,cache_off", [("0.12.1", True), ("0.12.0.1", False)])
def test_gloo_collectives_compile_here_on_a_jaxlib_that_deadlocks_on_cached_programs(
        set_up, monkeypatch, version, cache_off):
    monkeypatch.setattr(jaxlib, "__version__", version)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        initialize_from_env({**BASE, "JAX_PLATFORMS": "cpu"})
        initialize_from_env({**BASE, "MOEJAX_CPU_COLLECTIVES": "mpi"})  # not seen there
    off = ("jax_enable_compilation_cache", False)
    assert set_up.count(off) == cache_off
    if cache_off:  # before the runtime starts and anything compiles
        assert set_up.index(off) == set_up.index(("jax_cpu_collectives_implementation",
                                                  "gloo")) + 1


def test_a_study_refuses_a_malformed_setting_in_one_line(set_up, monkeypatch, capsys):
    for key, value in {**BASE, "MOEJAX_NUM_PROCESSES": "two"}.items():
        monkeypatch.setenv(key, value)
    ran = []
    code = experiment.main("x", lambda preset: None, lambda cfg, run: ran.append(1), [])
    assert code == 2 and ran == [] and set_up == []
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: MOEJAX_NUM_PROCESSES='two' must be a whole number >= 1"]
