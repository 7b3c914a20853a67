"""Settings from flags and environment: enum fields parse by value, and a bad value names its field."""

from __future__ import annotations

import re
import types

import pytest

from coordinator.settings import CoordinatorSettings
from draft_service.settings import DraftSettings
from specdec.common.settings import parse_settings, settings_parser
from specdec.engine.attention.selection import AttentionBackendChoice
from specdec.engine.model_runtime import ModelSettings
from specdec.sampling.rules import SamplingRule
from verify_service.settings import VerifySettings


def test_an_enum_setting_parses_its_values_from_flags_and_environment():
    assert parse_settings(CoordinatorSettings, [], environ={}).unseeded_sampling_rule is SamplingRule.REJECTION
    flag = ["--unseeded-sampling-rule", "coupled"]
    assert parse_settings(CoordinatorSettings, flag, environ={}).unseeded_sampling_rule is SamplingRule.COUPLED
    environ = {"SPECDEC_UNSEEDED_SAMPLING_RULE": "coupled"}
    assert parse_settings(CoordinatorSettings, [], environ=environ).unseeded_sampling_rule is SamplingRule.COUPLED


def test_a_bad_value_names_the_setting_and_the_choices():
    with pytest.raises(ValueError, match=r"unseeded_sampling_rule must be one of \['rejection', 'coupled'\]"):
        parse_settings(CoordinatorSettings, ["--unseeded-sampling-rule", "greedy"], environ={})
    with pytest.raises(ValueError, match="max_new_tokens_limit"):
        parse_settings(CoordinatorSettings, [], environ={"SPECDEC_MAX_NEW_TOKENS_LIMIT": "many"})


def test_help_shows_an_enum_default_by_its_value():
    assert re.search(r"default\s+'rejection'", settings_parser(CoordinatorSettings, "").format_help())


def test_both_model_services_take_the_execution_settings_into_their_model_settings():
    flags = ["--no-cuda-graphs", "--cuda-graph-max-tokens", "64", "--attention-backend", "flex", "--no-float32-logits"]
    for service in (DraftSettings, VerifySettings):
        defaults = ModelSettings.of(parse_settings(service, [], environ={}))
        assert defaults.cuda_graphs is True and defaults.float32_logits is True
        model = ModelSettings.of(parse_settings(service, flags, environ={}))
        assert (model.cuda_graphs, model.cuda_graph_max_tokens, model.float32_logits) == (False, 64, False)
        assert model.attention_backend is AttentionBackendChoice.FLEX


def test_a_service_lacking_a_model_setting_fails_naming_it():
    settings = parse_settings(VerifySettings, [], environ={})
    lacking = types.SimpleNamespace(**{k: v for k, v in vars(settings).items() if k != "kv_block_size"})
    with pytest.raises(AttributeError, match="kv_block_size"):
        ModelSettings.of(lacking)
