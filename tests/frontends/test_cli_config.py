"""`--config FILE` (TOML) gives defaults; flags on the command line win; unknown keys are named."""
import pytest

from engine.metrics import AdapterLabels
from frontends.cli import _apply_config, build_parser


def parse(argv):
    parser = build_parser()
    _apply_config(parser, argv)
    return parser.parse_args(argv)


def test_config_file_sets_defaults_and_flags_win(tmp_path):
    cfg = tmp_path / "serve.toml"
    cfg.write_text('port = 9100\nfrontends = 3\nmax_loras = 12\ndtype = "float32"\n')
    args = parse(["serve", "--config", str(cfg), "--port", "9200"])
    assert (args.port, args.frontends, args.max_loras, args.dtype) == (9200, 3, 12, "float32")


def test_shipped_config_parses():
    args = parse(["serve", "--config", "configs/default.toml"])
    assert args.frontends == 2 and args.max_lora_rank == 64
    assert args.max_loras is None and args.loader_threads == 1      # the defaults: no cap on adapters a step


def test_unknown_config_key_is_named(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("max_lora = 3\n")
    with pytest.raises(SystemExit, match="max_lora"):
        parse(["serve", "--config", str(cfg)])


def test_adapter_metric_labels_are_bounded():
    labels = AdapterLabels(limit=3)
    assert [labels(n) for n in ["a", "b", None, "c", "d", "a"]] == ["a", "b", "base", "c", "other", "a"]


@pytest.mark.parametrize("setting, named", [({"scheduling_policy": "lottery"}, "scheduling_policy"),
                                            ({"max_loras": 0}, "max_loras")])
def test_a_bad_engine_setting_is_one_line_naming_it(setting, named):
    import json
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "engine.serving.engine_proc", "--address", "ipc:///tmp/loraplex-unused",
                           "--engine-args", json.dumps({"model": "default", **setting})],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert f"loraplex: error: {named}" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
