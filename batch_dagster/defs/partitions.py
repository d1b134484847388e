"""Every partitions definition: one partition per batch, one per UTC day."""

import dagster as dg

# Each batch is one key; its key is the batch id.
batches = dg.DynamicPartitionsDefinition(name="batches")

# end_offset=0: the newest partition is yesterday, so today is never reported before it is over.
daily = dg.DailyPartitionsDefinition(start_date="2026-01-01", timezone="UTC", end_offset=0)
