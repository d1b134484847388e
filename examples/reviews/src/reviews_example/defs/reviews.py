"""The team's own table: 200 product reviews (data/reviews.csv, or the CSV file REVIEWS_CSV names)."""

import os
from pathlib import Path

import dagster as dg
import pandas as pd

SHIPPED = Path(__file__).resolve().parent.parent / "data" / "reviews.csv"


@dg.asset(group_name="reviews", kinds={"pandas", "csv"})
def reviews() -> pd.DataFrame:
    """Product reviews: review_id, product, stars (1 to 5) and text."""
    return pd.read_csv(os.environ.get("REVIEWS_CSV") or SHIPPED)
