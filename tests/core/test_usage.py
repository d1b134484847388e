"""Token usage totals and batch cost from a price table."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

import batch_dagster.batchfile as batchfile
from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.results import commit_shard
from batch_dagster.batchfile.usage import Cost, Price, PriceTable, Usage, cost_of
from batch_dagster.storage import LocalStorage

PRICES_TOML = Path(batchfile.__file__).resolve().parent.parent / "config" / "prices.toml"


# --- Usage.add_body -------------------------------------------------------------------------


def test_add_chat_usage():
    u = Usage()
    u.add_body(
        {
            "object": "chat.completion",
            "usage": {
                "prompt_tokens": 30,
                "completion_tokens": 12,
                "total_tokens": 42,
                "prompt_tokens_details": {"cached_tokens": 16},
                "completion_tokens_details": {"reasoning_tokens": 5},
            },
        }
    )
    assert (u.input_tokens, u.output_tokens, u.cached_tokens, u.reasoning_tokens) == (30, 12, 16, 5)
    assert u.total_tokens == 42


def test_add_completion_usage():
    u = Usage()
    u.add_body({"object": "text_completion", "usage": {"prompt_tokens": 7, "completion_tokens": 9, "total_tokens": 16}})
    assert (u.input_tokens, u.output_tokens, u.cached_tokens, u.reasoning_tokens) == (7, 9, 0, 0)
    assert u.total_tokens == 16


def test_add_embedding_usage():
    u = Usage()
    u.add_body({"object": "list", "data": [], "usage": {"prompt_tokens": 11, "total_tokens": 11}})
    assert (u.input_tokens, u.output_tokens) == (11, 0)
    assert u.total_tokens == 11


def test_add_body_accumulates_and_tolerates_missing_or_null_parts():
    u = Usage()
    u.add_body({"usage": {"prompt_tokens": 1, "completion_tokens": 2}})
    u.add_body({"usage": {"prompt_tokens": 3, "completion_tokens": None, "prompt_tokens_details": None,
                          "completion_tokens_details": None}})
    u.add_body({"usage": None})
    u.add_body({})
    assert (u.input_tokens, u.output_tokens, u.cached_tokens, u.reasoning_tokens) == (4, 2, 0, 0)


def test_usage_iadd_and_total():
    a = Usage(input_tokens=1, output_tokens=2, cached_tokens=3, reasoning_tokens=4)
    a += Usage(input_tokens=10, output_tokens=20, cached_tokens=30, reasoning_tokens=40)
    assert a == Usage(11, 22, 33, 44)
    assert a.total_tokens == 33


def test_usage_to_dict_has_batch_object_shape():
    d = Usage(input_tokens=5, output_tokens=7, cached_tokens=2, reasoning_tokens=1).to_dict()
    assert d == {
        "input_tokens": 5,
        "input_tokens_details": {"cached_tokens": 2},
        "output_tokens": 7,
        "output_tokens_details": {"reasoning_tokens": 1},
        "total_tokens": 12,
    }


def test_usage_from_dict_round_trip_and_defaults():
    u = Usage(input_tokens=5, output_tokens=7, cached_tokens=2, reasoning_tokens=1)
    assert Usage.from_dict(u.to_dict()) == u
    assert Usage.from_dict({}) == Usage()
    assert Usage.from_dict({"input_tokens": 3, "input_tokens_details": None}) == Usage(input_tokens=3)


# --- prices ---------------------------------------------------------------------------------


def test_price_defaults():
    p = Price()
    assert (p.input_per_1m, p.output_per_1m, p.batch_discount, p.currency) == (0.0, 0.0, 0.5, "USD")
    assert PriceTable().for_model("anything") == p


def test_price_table_from_dict_defaults_and_overrides():
    table = PriceTable.from_dict(
        {
            "defaults": {"input_per_1m": 1.0, "output_per_1m": 2.0, "batch_discount": 0.5, "currency": "USD"},
            "models": {
                "a": {"input_per_1m": 0.1, "output_per_1m": 0.4},
                "b": {"batch_discount": 0.25, "currency": "CNY"},
            },
        }
    )
    assert table.for_model("a") == Price(0.1, 0.4, 0.5, "USD")
    assert table.for_model("b") == Price(1.0, 2.0, 0.25, "CNY")
    assert table.for_model("unlisted") == Price(1.0, 2.0, 0.5, "USD")


def test_a_dotted_model_name_left_unquoted_in_the_price_table_is_named_with_how_to_quote_it():
    data = tomllib.loads("[models.qwen2.5-1.5b-instruct]\ninput_per_1m = 0.2\n")
    with pytest.raises(ValueError, match=r'has 5-1: not a price\'s field .* quoted, as \[models\."qwen2\.5-1\.5b-instruct"\]'):
        PriceTable.from_dict(data)
    quoted = PriceTable.from_dict(tomllib.loads('[models."qwen2.5-1.5b-instruct"]\ninput_per_1m = 0.2\n'))
    assert quoted.for_model("qwen2.5-1.5b-instruct").input_per_1m == 0.2


def test_price_table_from_dict_without_defaults():
    table = PriceTable.from_dict({"models": {"a": {"input_per_1m": 3.0}}})
    assert table.for_model("a") == Price(input_per_1m=3.0)
    assert table.for_model("a").batch_discount == 0.5
    assert table.for_model("z") == Price()


def test_price_table_rejects_unknown_keys():
    with pytest.raises(ValueError, match=r"\[models.a\] has input_price"):
        PriceTable.from_dict({"models": {"a": {"input_price": 3.0}}})
    with pytest.raises(ValueError, match=r"\[windows.1h\] has discount"):
        PriceTable.from_dict({"windows": {"1h": {"discount": 0.2}}})
    with pytest.raises(ValueError, match=r"\[models.a.windows.1h\] has x"):
        PriceTable.from_dict({"models": {"a": {"windows": {"1h": {"x": 1}}}}})


def test_shipped_price_file_loads():
    with open(PRICES_TOML, "rb") as f:
        table = PriceTable.from_dict(tomllib.load(f))
    assert table.default.batch_discount == 0.5
    small = table.for_model("smollm2-135m-instruct")
    assert small.input_per_1m > 0 and small.output_per_1m > 0
    assert small.batch_discount == 0.5
    emb = table.for_model("all-minilm-l6-v2")
    assert emb.input_per_1m > 0
    assert emb.batch_discount == 0.5
    # Each window the settings offer by default has its price; the 1h window is discounted less than the 24h one.
    assert set(table.windows) >= {"1h", "24h"}
    assert table.for_model("smollm2-135m-instruct", "24h").batch_discount == 0.5
    assert table.for_model("smollm2-135m-instruct", "1h").batch_discount < 0.5


# --- cost_of --------------------------------------------------------------------------------

TABLE = PriceTable.from_dict(
    {
        "defaults": {"batch_discount": 0.5},
        "models": {
            "m": {"input_per_1m": 2.0, "output_per_1m": 8.0},
            "full": {"input_per_1m": 2.0, "output_per_1m": 8.0, "batch_discount": 0.0},
            "quarter": {"input_per_1m": 2.0, "output_per_1m": 8.0, "batch_discount": 0.25},
        },
    }
)


def test_a_window_prices_its_batches_over_the_models_price_and_a_models_own_entry_over_both():
    table = PriceTable.from_dict({
        "defaults": {"batch_discount": 0.5},
        "windows": {"1h": {"batch_discount": 0.2}},
        "models": {"m": {"input_per_1m": 2.0, "batch_discount": 0.6},
                   "own": {"input_per_1m": 2.0, "windows": {"1h": {"batch_discount": 0.1, "input_per_1m": 3.0}}}},
    })
    usage = Usage(input_tokens=1_000_000)
    assert cost_of(usage, "m", table).total_cost == pytest.approx(0.8)  # no window: the model's own discount
    assert cost_of(usage, "m", table, "24h").total_cost == pytest.approx(0.8)  # a window with no entry: the same
    assert cost_of(usage, "m", table, "1h").total_cost == pytest.approx(1.6)  # the window's discount replaces it
    assert cost_of(usage, "own", table, "1h").total_cost == pytest.approx(2.7)  # its own: 3.0 at 10% off
    assert cost_of(usage, "unlisted", table, "1h").batch_discount == 0.2


def test_cost_applies_default_half_discount():
    cost = cost_of(Usage(input_tokens=1_000_000, output_tokens=500_000), "m", TABLE)
    assert cost.input_cost == pytest.approx(1.0)  # 2.0 * 1M/1M * 0.5
    assert cost.output_cost == pytest.approx(2.0)  # 8.0 * 0.5M/1M * 0.5
    assert cost.total_cost == pytest.approx(3.0)
    assert cost.batch_discount == 0.5
    assert cost.currency == "USD"
    assert cost.model == "m"


@pytest.mark.parametrize(("model", "factor"), [("full", 1.0), ("quarter", 0.75), ("m", 0.5)])
def test_cost_discount_per_model(model, factor):
    cost = cost_of(Usage(input_tokens=250_000, output_tokens=125_000), model, TABLE)
    assert cost.input_cost == pytest.approx(0.5 * factor)
    assert cost.output_cost == pytest.approx(1.0 * factor)


def test_cost_of_unpriced_model_is_zero():
    cost = cost_of(Usage(input_tokens=10**9, output_tokens=10**9), "unknown", TABLE)
    assert cost.total_cost == 0.0


def test_cost_small_batches_are_not_rounded_to_zero():
    cost = cost_of(Usage(input_tokens=100, output_tokens=50), "m", TABLE)
    assert cost.input_cost == pytest.approx(100 * 2.0 / 1e6 * 0.5)
    assert cost.output_cost == pytest.approx(50 * 8.0 / 1e6 * 0.5)
    assert cost.total_cost > 0


def test_cached_input_tokens_are_priced_at_their_own_rate_with_the_batch_discount():
    table = PriceTable.from_dict({"models": {"m": {"input_per_1m": 1.0, "cached_input_per_1m": 0.25,
                                                   "output_per_1m": 4.0, "batch_discount": 0.5}}})
    cost = cost_of(Usage(input_tokens=1_000_000, cached_tokens=400_000, output_tokens=1_000_000), "m", table)
    assert cost.cached_input_cost == pytest.approx(0.4 * 0.25 * 0.5)
    assert cost.input_cost == pytest.approx((0.6 * 1.0 + 0.4 * 0.25) * 0.5)
    assert cost.total_cost == pytest.approx(cost.input_cost + 4.0 * 0.5)
    # Without a cached rate, cached tokens cost the input rate.
    plain = cost_of(Usage(input_tokens=1_000_000, cached_tokens=400_000), "m", PriceTable.from_dict(
        {"models": {"m": {"input_per_1m": 1.0}}}))
    assert plain.input_cost == pytest.approx(0.5) and plain.cached_input_cost == pytest.approx(0.2)


def test_cost_to_dict():
    cost = cost_of(Usage(input_tokens=1_000_000, output_tokens=1_000_000), "m", TABLE)
    d = cost.to_dict()
    assert d == {
        "model": "m",
        "input_cost": pytest.approx(1.0),
        "output_cost": pytest.approx(4.0),
        "batch_discount": 0.5,
        "currency": "USD",
        "cached_input_cost": 0.0,
        "total_cost": pytest.approx(5.0),
    }
    # Round trip: the dict without its derived total builds the same Cost, with the same total.
    rebuilt = Cost(**{k: v for k, v in d.items() if k != "total_cost"})
    assert rebuilt == cost and rebuilt.to_dict() == d


def test_only_successful_requests_are_billed(tmp_path):
    ok = c.success_line("a", {"usage": {"prompt_tokens": 400_000, "completion_tokens": 100_000}})
    failed = {
        "id": "x",
        "custom_id": "b",
        "response": {"status_code": 400, "request_id": "r",
                     "body": {"error": {"code": "invalid_request"}, "usage": {"prompt_tokens": 10**7}}},
        "error": None,
    }
    never = c.not_run_line("c", c.BATCH_EXPIRED, "expired")
    summary = commit_shard(LocalStorage(tmp_path), "results", 0, [ok, failed, never])
    cost = cost_of(summary.usage, "m", TABLE)
    assert cost.input_cost == pytest.approx(0.4)  # 0.4M * 2.0 * 0.5
    assert cost.output_cost == pytest.approx(0.4)  # 0.1M * 8.0 * 0.5


def test_a_model_missing_from_the_price_table_is_named_with_the_defaults_it_gets():
    table = PriceTable.from_dict({"defaults": {"input_per_1m": 0.0, "output_per_1m": 0.0},
                                  "models": {"listed": {"input_per_1m": 1.0}}})
    assert table.unlisted("listed") is None
    assert table.unlisted("other") == ("model 'other' is not in the price table: priced at its [defaults] "
                                       "(0.0 input, 0.0 output USD per 1M tokens)")
