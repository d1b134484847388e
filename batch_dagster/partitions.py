"""Each batch is one key of this dynamic partitions definition; its key is the batch id."""

import dagster as dg

batches = dg.DynamicPartitionsDefinition(name="batches")
