"""The table batch component: a Dagster component (`dg scaffold defs`, configured in YAML) that turns a table asset
of a team's own project into an answered table asset, each row asked of a model through batch-dagster's pipeline."""


from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any

import dagster as dg
from pydantic import BaseModel, Field

from batch_dagster.batchfile.options import BatchOptions
from batch_dagster.batchfile.table import TableRequest, TableSpecError, check_key_columns
from batch_dagster.client import BatchService
from batch_dagster.defs.assets.inference import step_retries
from batch_dagster.defs.resources import PipelineConfig, StorageResource, VLLMResource
from batch_dagster.defs.resources.setting_fields import from_settings
from batch_dagster.settings import Settings

from .io_manager import TableIOManager
from .run import CHECK, TABLE_DEFAULTS, TableBatch, answer_table

# The resources a table batch's asset uses, under keys of their own (a project's `storage` or `vllm` stay its own).
STORAGE, PIPELINE, VLLM = "batch_storage", "batch_pipeline", "batch_vllm"
IO_MANAGER = "batch_tables_io_manager"
# The Dagster pool of the table batches that load the model in their own process: a project bounds them with
# `dagster instance concurrency set batch_engine 1` (a backfill of many partitions would otherwise load the model
# in as many runs at once).
ENGINE_POOL = "batch_engine"


class RequestModel(dg.Model):
    """What each row asks: a chat (`user`, with an optional `system`), a completion (`prompt`) or an embedding
    (`input`), each a template naming the row's columns as {column}."""

    model: str = Field(description="A model of the registry (BATCH_MODELS_FILE), e.g. smollm2-135m-instruct.")
    system: str | None = Field(None, description="The system message (chat).")
    user: str | None = Field(None, description="The user message (chat), e.g. 'Review: {text}'.")
    prompt: str | None = Field(None, description="The prompt (completions).")
    input: str | None = Field(None, description="The text to embed (embeddings).")
    params: dict[str, Any] = Field(default_factory=dict, description="Further request fields: temperature, "
                                   "max_tokens, seed, stop, ... (temperature 0 or a seed makes answers reusable).")
    json_schema: dict[str, Any] | None = Field(None, description="A JSON schema the answer follows (structured "
                                               "outputs); its properties become typed columns.")
    schema_name: str = Field("answer", description="The schema's name in response_format.")


def _request(context: dg.ResolutionContext, model: RequestModel) -> TableRequest:
    try:
        return TableRequest.from_dict(context.resolve_value(model.model_dump(exclude_none=True)), "request.")
    except TableSpecError as exc:
        raise ValueError(f"The table batch's {exc}") from None


_BUILT: dict[str, dict[str, Any]] = {}  # by the settings' repr: they hold a dict (BATCH_FLEET_URLS), no hash


def _resources(settings: Settings) -> dict[str, Any]:
    """One object per resource whatever the number of components, as Definitions.merge wants them (the same
    settings, the same objects). No metadata store: a project's batches have no API key, no queue and no row."""
    if (key := repr(settings)) not in _BUILT:
        _BUILT[key] = _build_resources(settings)
    return _BUILT[key]


def _build_resources(settings: Settings) -> dict[str, Any]:
    storage = from_settings(StorageResource, settings)
    return {STORAGE: storage, PIPELINE: from_settings(PipelineConfig, settings),
            VLLM: from_settings(VLLMResource, settings),
            IO_MANAGER: TableIOManager(data_dir=storage.data_dir, url=storage.url)}


def _partitions_in(values: Iterable[Any], key: dg.AssetKey) -> tuple[bool, dg.PartitionsDefinition | None]:
    """Whether some of `values` (a module's, a component's assets) define the asset `key`, and its partitions."""
    for value in values:
        if isinstance(value, dg.AssetsDefinition) and key in value.keys:
            return True, value.specs_by_key[key].partitions_def
        if isinstance(value, dg.AssetSpec) and value.key == key:
            return True, value.partitions_def
    return False, None


_SEARCHING: set[Path] = set()  # the component folders whose upstream is being looked for (a chain of them)


def upstream_partitions(context: dg.ComponentLoadContext, key: dg.AssetKey) -> dg.PartitionsDefinition | None:
    """The partitions of the upstream asset, found among the Python modules of the project's defs folder, else
    among the assets of its other components (built through the context, which keeps the dependency)."""
    root = Path(context.defs_module_path)
    for path in sorted(root.rglob("*.py")):
        found, partitions = _partitions_in(vars(context.load_defs_relative_python_module(path)).values(), key)
        if found:
            return partitions
    _SEARCHING.add(context.path)
    try:
        for folder in sorted({yaml.parent for yaml in root.rglob("defs.yaml")} - _SEARCHING):
            found, partitions = _partitions_in(context.build_defs(folder).assets or (), key)
            if found:
                return partitions
    finally:
        _SEARCHING.discard(context.path)
    return None


class ScaffoldParams(BaseModel):
    upstream: str = Field("my_table", description="The table asset whose rows are asked.")
    model: str = Field("smollm2-135m-instruct", description="The model that answers.")


class TableBatchScaffolder(dg.Scaffolder[ScaffoldParams]):
    """A defs.yaml to fill in: the answered asset named after its folder, a chat template, deterministic sampling."""

    @classmethod
    def get_scaffold_params(cls) -> type[ScaffoldParams]:
        return ScaffoldParams

    def scaffold(self, request: dg.ScaffoldRequest[ScaffoldParams]) -> None:
        params = request.params or ScaffoldParams()
        dg.scaffold_component(request, {
            "asset": {"key": Path(request.target_path).name},
            "upstream": params.upstream,
            "key_columns": ["id"],
            "request": {"model": params.model, "system": "Answer in one short sentence.",
                        "user": "{text}", "params": {"temperature": 0, "max_tokens": 64}},
        })


@dg.scaffold_with(TableBatchScaffolder)
class TableBatchComponent(dg.Component, dg.Resolvable, dg.Model, BatchOptions):
    """Answers each row of a table asset with a model: one batch per partition, into an answered table asset.

    Its options are a batch's (BatchOptions: reuse, max_cost, ...); those it leaves unset are a table batch's
    defaults (defs/table/run.py TABLE_DEFAULTS: answers reused), then the operator's.

    The answered table has the row's position, the key columns, the answer (or the JSON schema's typed columns, or
    the embedding), finish_reason, token usage, whether the answer was reused, and an error for each row that has
    none. It runs in the asset's process (the in-process engine, or the fleet the environment names) or on a
    batch-dagster service."""

    asset: dg.ResolvedAssetSpec = Field(description="The answered table's asset: key, group_name, description, "
                                        "partitions_def (default: the upstream's), owners, tags.")
    upstream: dg.ResolvedAssetKey = Field(description="The table asset whose rows are asked, read through its "
                                          "own IO manager.")
    request: Annotated[TableRequest, dg.Resolver(_request, model_field_type=RequestModel)]
    key_columns: list[str] = Field(default_factory=list, description="Upstream columns copied beside each answer.")
    namespace: str | None = Field(None, min_length=1, max_length=128, description="Whose answers and cached "
                                  "prompt prefixes this batch meets, in its process: those of the table batches of the "
                                  "same namespace (and of the owners BATCH_SHARED_OWNERS shares with it). Default: the "
                                  "project's (its defs module's top package).")
    service_url: str | None = Field(None, description="A batch-dagster service's /v1 URL: the batch runs there.")
    service_api_key: str | None = Field(None, description="Its API key, e.g. '{{ env.LLM_SERVICE_KEY }}'.")
    io_manager_key: str = Field(IO_MANAGER, description="The answered table's IO manager; the default writes "
                                "Parquet under tables/ where the batch folders live.")

    def table_batch(self, project: str = "") -> TableBatch:
        service = BatchService(self.service_url, self.service_api_key) if self.service_url else None
        return TableBatch(self.request, tuple(self.key_columns), BatchOptions.of(self).resolved(TABLE_DEFAULTS),
                          service, self.namespace or project)

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        try:
            check_key_columns(self.request, self.key_columns)
        except TableSpecError as exc:
            raise ValueError(f"The table batch's {exc}") from None
        spec = self.asset
        partitions = spec.partitions_def or upstream_partitions(context, self.upstream)
        batch = self.table_batch(project=context.defs_module_name.split(".")[0])
        settings = Settings.from_env()
        resources = _resources(settings)
        in_process = batch.service is None and resources[VLLM].server_urls_for(self.request.model) is None

        @dg.asset(
            key=spec.key,
            ins={"upstream": dg.AssetIn(key=self.upstream)},
            partitions_def=partitions,
            backfill_policy=dg.BackfillPolicy.multi_run(1) if partitions is not None else None,
            group_name=spec.group_name,
            description=spec.description or f"{self.upstream.to_user_string()}'s rows answered by "
                                            f"{self.request.model}.",
            metadata={**spec.metadata, "request": dg.MetadataValue.json(_shown(self.request))},
            tags=spec.tags,
            owners=spec.owners,
            kinds={*spec.kinds, "vllm"} if len(spec.kinds) < 3 else set(spec.kinds),
            code_version=spec.code_version,
            io_manager_key=self.io_manager_key,
            required_resource_keys={STORAGE, PIPELINE, VLLM},
            check_specs=[dg.AssetCheckSpec(CHECK, asset=spec.key, description="Every upstream row has exactly one "
                                           "row here, with an answer or an error.")],
            retry_policy=step_retries(settings.step_retry_delay_s),
            pool=ENGINE_POOL if in_process else None,
        )
        def _answered(context: dg.AssetExecutionContext, upstream: Any):
            r = context.resources
            yield from answer_table(context, upstream, batch, getattr(r, STORAGE), getattr(r, PIPELINE),
                                    getattr(r, VLLM))

        shared = {k: v for k, v in resources.items() if k != IO_MANAGER or self.io_manager_key == IO_MANAGER}
        return dg.Definitions(assets=[_answered], resources=shared)


def _shown(request: TableRequest) -> dict[str, Any]:
    shown: Mapping[str, Any] = {"model": request.model, "endpoint": request.endpoint, **request.templates(),
                                "params": dict(request.params)}
    return {**shown, **({"json_schema": dict(request.json_schema)} if request.json_schema else {})}
