"""Generate the example project's product reviews, `examples/reviews/src/reviews_example/data/reviews.csv`.

Deterministic (fixed seed, standard library only): running it twice writes the same bytes.

    python tools/make_reviews.py

200 reviews of ten products, each assembled from hand-written openings, details and verdicts whose tone
follows its star rating (1 to 5), about one of five topics: quality, shipping, price, support, usability.
"""

from __future__ import annotations

import csv
import random
from pathlib import Path

SEED = 20261202
ROWS = 200
OUT = Path(__file__).resolve().parent.parent / "examples" / "reviews" / "src" / "reviews_example" / "data" / \
    "reviews.csv"

PRODUCTS = ["electric kettle", "desk lamp", "wireless mouse", "rain jacket", "coffee grinder", "yoga mat",
            "bluetooth speaker", "backpack", "phone case", "air fryer"]
TOPICS = {
    "quality": {
        "good": ["The build feels solid and it has held up to daily use.", "Materials are sturdy and well finished.",
                 "It works exactly as described, every single time."],
        "bad": ["It broke after two weeks of normal use.", "The plastic cracked the first time I dropped it.",
                "One part stopped working within a month."],
    },
    "shipping": {
        "good": ["It arrived two days early, well packed.", "Delivery was fast and the box was undamaged.",
                 "Shipping took one day and tracking was accurate."],
        "bad": ["It arrived ten days late with a crushed box.", "The parcel was lost once and resent a week later.",
                "Delivery took three weeks and nobody said why."],
    },
    "price": {
        "good": ["For the price it is a bargain.", "Cheaper than the big brands and just as good.",
                 "Great value, I bought a second one as a gift."],
        "bad": ["Far too expensive for what you get.", "The price went up the day after I ordered.",
                "Not worth the money, cheaper ones do the same."],
    },
    "support": {
        "good": ["Customer service replaced it without any questions.", "Support answered my email within an hour.",
                 "The help line walked me through the setup kindly."],
        "bad": ["Support never answered my three emails.", "The refund took two months of phone calls.",
                "Customer service was rude and unhelpful."],
    },
    "usability": {
        "good": ["It is very easy to set up and use.", "The controls are simple and the manual is clear.",
                 "Anyone in the family can use it without help."],
        "bad": ["The buttons are confusing and the manual is useless.", "Setting it up took me an hour of guessing.",
                "It is awkward to use and hard to clean."],
    },
}
OPENINGS = {5: ["Absolutely love this {p}.", "Best {p} I have owned."], 4: ["Very happy with this {p}.",
            "A good {p} overall."], 3: ["This {p} is okay.", "Mixed feelings about this {p}."],
            2: ["Disappointed with this {p}.", "I expected more from this {p}."],
            1: ["Terrible {p}, do not buy.", "The worst {p} I have bought."]}
VERDICTS = {5: "Highly recommended.", 4: "I would buy it again.", 3: "It does the job, nothing more.",
            2: "I would not buy it again.", 1: "Returning it today."}


def review(rng: random.Random, index: int) -> dict[str, object]:
    stars = rng.choice([1, 2, 3, 4, 5, 5, 4])
    product, topic = rng.choice(PRODUCTS), rng.choice(list(TOPICS))
    tone = "good" if stars >= 4 else "bad" if stars <= 2 else rng.choice(["good", "bad"])
    text = " ".join([rng.choice(OPENINGS[stars]).format(p=product), rng.choice(TOPICS[topic][tone]),
                     VERDICTS[stars]])
    return {"review_id": f"r{index:03d}", "product": product, "stars": stars, "text": text}


def main() -> None:
    rng = random.Random(SEED)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with open(OUT, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=["review_id", "product", "stars", "text"], lineterminator="\n")
        writer.writeheader()
        writer.writerows(review(rng, i) for i in range(1, ROWS + 1))
    print(f"wrote {ROWS} reviews to {OUT}")


if __name__ == "__main__":
    main()
