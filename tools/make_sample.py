"""Generate the built-in demo batch, `batch_dagster/demo/sample_batch.jsonl` (not shipped in the package).

Deterministic (fixed seed, standard library only): running it twice writes the same bytes.

    python tools/make_sample.py

The file holds 240 OpenAI-format chat requests for the embedded default model, in five task
families that each share one system prompt per task (so prefix caching helps): short factual
questions, one-sentence summaries, one-label classification of customer reviews, field
extraction into JSON, and translation (English to French and Spanish, Chinese to English).
Every text below is hand-written; some are assembled from hand-written parts for variety.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 20240611
MODEL = "smollm2-135m-instruct"
URL = "/v1/chat/completions"
OUT = Path(__file__).resolve().parent.parent / "batch_dagster" / "demo" / "sample_batch.jsonl"

SYSTEM = {
    "qa": "You are a concise assistant. Answer the question in one short sentence.",
    "summary": "Summarize the text in one sentence of at most 25 words. Reply with the summary only.",
    "classify-sentiment": (
        "Classify the sentiment of the customer review. "
        "Answer with exactly one label: positive, negative, or neutral."
    ),
    "classify-topic": (
        "Classify the main topic of the customer review. Answer with exactly one label: "
        "shipping, billing, product_quality, customer_service, or usability."
    ),
    "extract": (
        "Extract the customer or sender name, the date, and the total amount from the document. "
        'Reply with only a JSON object with the keys "name", "date" and "amount".'
    ),
    "translate-fr": "Translate the user's text from English to French. Reply with the translation only.",
    "translate-es": "Translate the user's text from English to Spanish. Reply with the translation only.",
    "translate-zh": "Translate the user's text from Chinese to English. Reply with the translation only.",
}

# --------------------------------------------------------------------------------------------
# Factual questions. The first five, with well-known short answers, open the file.
# --------------------------------------------------------------------------------------------

QA_FIRST = [
    "What is the capital of France?",
    "What is 2 + 2?",
    "How many days are there in a week?",
    "What is the largest planet in our solar system?",
    "What is the chemical formula for water?",
]

CAPITALS = [
    "Japan", "Italy", "Germany", "Spain", "Canada", "Australia", "Egypt",
    "Brazil", "Kenya", "Norway", "Mexico", "South Korea", "Argentina", "India",
]

SCIENCE = [
    "At what temperature in degrees Celsius does water boil at sea level?",
    "How many legs does a spider have?",
    "Which gas do plants absorb from the air for photosynthesis?",
    "Which planet is known as the Red Planet?",
    "How many continents are there on Earth?",
    "What is the freezing point of water in degrees Fahrenheit?",
    "Who wrote the play Romeo and Juliet?",
    "What is the hardest natural substance?",
    "How many minutes are there in an hour?",
    "What is the largest ocean on Earth?",
    "Which organ pumps blood through the human body?",
    "What is the chemical symbol for gold?",
    "How many sides does a hexagon have?",
    "What is the tallest mountain in the world?",
    "What force pulls objects toward the center of the Earth?",
    "What is the closest star to the Earth?",
]


def qa_questions(rng: random.Random) -> list[tuple[str, int]]:
    out = [(q, 24) for q in QA_FIRST]
    out += [(f"What is the capital of {country}?", 24) for country in CAPITALS]
    ops = ["+", "-", "times", "+", "-", "times", "divided by"]
    for i in range(13):
        op = ops[i % len(ops)]
        if op == "+":
            a, b = rng.randint(12, 99), rng.randint(12, 99)
        elif op == "-":
            a = rng.randint(40, 199)
            b = rng.randint(3, a - 1)
        elif op == "times":
            a, b = rng.randint(3, 15), rng.randint(3, 12)
        else:
            b = rng.randint(2, 9)
            a = b * rng.randint(3, 12)
        out.append((f"What is {a} {op} {b}?", 24))
    out += [(q, 32) for q in SCIENCE]
    return out


# --------------------------------------------------------------------------------------------
# Summaries: news (hand-written), product descriptions and support tickets (assembled).
# --------------------------------------------------------------------------------------------

NEWS = [
    "The city council of Millbrook voted 7 to 2 on Tuesday to convert three downtown parking "
    "lots into a public park. Construction is expected to begin in the spring and cost about "
    "$4.2 million, paid mostly by a state grant. Opponents argued that local shops would lose "
    "customers who drive in from nearby towns.",
    "Heavy rain flooded several roads in the northern districts overnight, forcing the closure "
    "of Route 9 between Ashford and Kelby. No injuries were reported, but around 1,200 homes "
    "lost power for up to six hours. The weather service expects the rain to ease by Thursday "
    "afternoon.",
    "Northwind Rail announced that it will add a late-evening train between Harlow and the "
    "airport starting in September. The company said ridership on the line has grown by 18 "
    "percent since last year. Tickets for the new service will cost the same as daytime fares.",
    "A local high school robotics team from Fairview won first place at the national finals "
    "last weekend, beating 64 other schools. Their robot sorted recycled materials faster than "
    "any other entry. The team plans to donate part of its $10,000 prize to the school library.",
    "The regional hospital opened a new emergency wing on Monday that doubles the number of "
    "treatment rooms to 40. Officials said average waiting times should fall from three hours "
    "to under ninety minutes. The project took two years and was delayed by supply shortages.",
    "Brightfield Foods reported quarterly revenue of $312 million, up 6 percent from a year "
    "earlier, driven by strong sales of its frozen meals. However, the company lowered its "
    "full-year profit forecast, citing higher packaging and transport costs. Its shares fell "
    "4 percent in early trading.",
    "Scientists at the coastal research station have recorded the highest number of nesting sea "
    "turtles on the island in two decades. Volunteers counted 412 nests this season, compared "
    "with about 250 last year. Researchers credit a ban on night-time beach lighting introduced "
    "in 2021.",
    "The public library in Oakdale will stay open until 10 p.m. on weekdays during the exam "
    "period, the library board said. The extended hours run from May 1 to June 15 and are "
    "funded by a donation from a local credit union. Students must show a school ID after 8 p.m.",
    "A fire at a warehouse in the Eastgate industrial zone was brought under control after "
    "five hours on Saturday. Firefighters said the building, which stored furniture, was "
    "badly damaged. Residents nearby were told to keep windows closed because of the smoke.",
    "The national statistics office said unemployment fell to 4.1 percent in March, its lowest "
    "level in three years. Most new jobs were created in healthcare and construction. Wage "
    "growth, however, remained slower than inflation for the sixth month in a row.",
    "Greenway Cycles will open a bike-sharing scheme in Port Elling next month with 300 bikes "
    "at 25 stations. Rides under thirty minutes will be free for residents who register online. "
    "The city hopes the scheme will cut car traffic in the old town.",
    "Farmers in the Calder Valley say this year's apple harvest is about a third smaller than "
    "usual after a late frost in April damaged the blossoms. Prices at local markets have "
    "already risen. Several orchards have cancelled their autumn pick-your-own events.",
    "The annual jazz festival in Riverton drew a record 45,000 visitors over three days, "
    "organizers said on Sunday. More than 60 bands played on five stages along the waterfront. "
    "Hotels in the town reported being fully booked for the entire weekend.",
    "A software glitch at Meridian Bank left thousands of customers unable to use their cards "
    "for about four hours on Friday morning. The bank apologized and said no money was lost. "
    "It promised to refund any fees charged because of failed payments.",
    "The education ministry announced that all primary schools will receive free breakfast "
    "programs from next January. The plan will cost around $90 million a year and reach "
    "roughly 600,000 children. Teachers' unions welcomed the move but asked for more staff.",
    "Astronomers using a mountain-top telescope in Chile have discovered a planet about twice "
    "the size of Earth orbiting a nearby red dwarf star. The planet completes an orbit every "
    "nine days. Scientists say it is probably too hot to support liquid water.",
]

PRODUCTS = [
    ("The Aero 3 cordless vacuum", "weighs just 1.4 kilograms", "runs for up to 45 minutes on a single charge",
     "busy households with pets", 189),
    ("The Lumen desk lamp", "offers five color temperatures", "has a USB-C port for charging a phone",
     "students and home-office workers", 49),
    ("The TrailMate 2 hiking backpack", "holds 28 liters", "includes a built-in rain cover",
     "weekend hikers", 79),
    ("The BrewPro drip coffee maker", "brews ten cups in under six minutes", "keeps coffee warm for two hours",
     "families and small offices", 65),
    ("The Quill e-reader", "has a glare-free 7-inch screen", "lasts up to six weeks between charges",
     "people who read every day", 139),
    ("The SoundNest wireless headset", "blocks background noise", "offers eight hours of playback",
     "commuters", 99),
    ("The FlexFit yoga mat", "is 6 millimeters thick", "is made from recycled rubber",
     "beginners and experienced yogis alike", 42),
    ("The ChefEdge knife set", "contains six stainless-steel knives", "comes with a bamboo storage block",
     "home cooks", 120),
    ("The HomeAir purifier", "cleans a 40-square-meter room in twenty minutes", "runs almost silently at night",
     "allergy sufferers", 159),
    ("The PixelPal kids' tablet", "has a shock-proof case", "comes with parental controls",
     "children aged five to ten", 110),
    ("The Velo smart bike light", "brightens automatically in tunnels", "flashes when you brake",
     "city cyclists", 35),
    ("The AquaSip insulated bottle", "keeps drinks cold for 24 hours", "fits in most car cup holders",
     "runners and travelers", 28),
    ("The GardenPro hose reel", "stores 30 meters of hose", "rolls on two sturdy wheels",
     "gardeners with large yards", 58),
    ("The SnapShot instant camera", "prints photos in about 90 seconds", "has a built-in selfie mirror",
     "parties and weddings", 85),
    ("The ThermoNest smart thermostat", "learns your schedule in one week", "can be controlled from a phone app",
     "homeowners who want lower energy bills", 149),
    ("The WriteRight ergonomic keyboard", "has a split layout", "includes a padded wrist rest",
     "people who type for many hours", 95),
]

PRODUCT_TEMPLATES = [
    "{name} {f1} and {f2}. It is designed for {aud}. {avail} It costs ${price}.",
    "Meet {lname}: it {f1}, and it {f2}. Made with {aud} in mind, it sells for ${price}. {avail}",
    "Looking for something new? {name} {f1}, {f2}, and comes with {warranty}. "
    "Priced at ${price}, it is a good fit for {aud}. {avail}",
    "{name} is our most popular model for {aud}. It {f1} and {f2}. {avail} "
    "Every unit comes with {warranty}.",
]

AVAILABILITY = [
    "It is available in black, white and sage green.",
    "Orders placed before noon ship the same day.",
    "It goes on sale in stores on the first of next month.",
    "It is currently sold online only.",
    "Stock is limited during the launch week.",
    "Customers can return it within 30 days for a full refund.",
]

WARRANTIES = ["a two-year warranty", "a one-year warranty", "a five-year guarantee", "a three-year warranty"]

TICKET_NAMES = [
    "Maria Lopez", "James Carter", "Aisha Khan", "Tom Becker", "Yuki Tanaka", "Olivia Brown",
    "Daniel Novak", "Fatima Ali", "Lucas Martin", "Grace Okafor", "Ethan Walsh", "Priya Nair",
    "Sofia Rossi", "Ben Harris", "Chen Wei", "Emma Larsen",
]

TICKET_ISSUES = [
    ("I was charged twice for my March subscription", "I can see both payments on my bank statement",
     "Please refund the extra payment as soon as possible."),
    ("the mobile app crashes every time I open the settings page", "I reinstalled it and restarted my phone",
     "Is there a fix coming, or a workaround I can use until then?"),
    ("my order #48213 still shows 'processing' after ten days", "the tracking link does not work",
     "Please tell me when it will ship, or cancel the order."),
    ("I cannot reset my password because the reset email never arrives", "I checked my spam folder twice",
     "Could you reset it manually or send the link to my work address?"),
    ("the blender I received has a cracked jug", "the box looked damaged when it was delivered",
     "I would like a replacement rather than a refund."),
    ("my smart thermostat disconnects from Wi-Fi every evening", "I moved the router closer and updated the firmware",
     "Could someone call me back today? I need this fixed before the weekend."),
    ("the discount code SPRING20 is rejected at checkout", "I tried it on both the website and the app",
     "Please apply the discount to my order manually."),
    ("I was sent the wrong size of running shoes", "I ordered a size 42 and received a 39",
     "Please send a prepaid return label and the correct size."),
    ("my account was locked after I changed my phone number", "the verification code goes to my old number",
     "Please tell me what information you need from me to unlock it."),
    ("the invoice for April lists a product I never ordered", "the item is a $35 phone case",
     "Please correct the invoice and remove the charge."),
    ("my video calls keep freezing since the last update", "other apps work fine on the same connection",
     "This is the second time I am writing about this, so I would appreciate a quick answer."),
    ("I cancelled my plan in January but was billed again in February", "I still have the cancellation email",
     "Please refund February and confirm that the plan is closed."),
    ("the printer shows a paper jam error when there is no paper stuck", "I opened every panel and cleaned the rollers",
     "The printer is still under warranty, so I would like it repaired or replaced."),
    ("my gift card balance shows zero even though I have not used it", "the card number is printed on the receipt",
     "Please restore the balance of $50."),
    ("the delivery driver left my package at the wrong address", "a neighbor two streets away found it by chance",
     "Please make sure the driver has my correct address for future orders."),
    ("I cannot download my data export from the account page", "the button shows a spinning wheel and nothing happens",
     "If it cannot be fixed, please email me the export instead."),
]

TICKET_TEMPLATES = [
    "Support ticket from {name}: {issue_cap}. {tried_cap}. {ask}",
    "Hello, my name is {name}. I am writing because {issue}. {tried_cap}. {ask}",
    'Forwarded from the contact form. Name: {name}. Priority: {priority}. '
    'Message: "Hi, {issue}. {tried_cap}. {ask}"',
]

PRIORITY = ["high", "medium", "low"]


def _cap(s: str) -> str:
    return s[0].upper() + s[1:]


def summaries(rng: random.Random) -> list[str]:
    news = list(NEWS)
    products = []
    for i, (name, f1, f2, aud, price) in enumerate(PRODUCTS):
        template = PRODUCT_TEMPLATES[i % len(PRODUCT_TEMPLATES)]
        products.append(
            template.format(
                name=name,
                lname=name[0].lower() + name[1:],
                f1=f1,
                f2=f2,
                aud=aud,
                price=price,
                avail=rng.choice(AVAILABILITY),
                warranty=rng.choice(WARRANTIES),
            )
        )
    names = rng.sample(TICKET_NAMES, len(TICKET_NAMES))
    tickets = []
    for i, (issue, tried, ask) in enumerate(TICKET_ISSUES):
        template = TICKET_TEMPLATES[i % len(TICKET_TEMPLATES)]
        tickets.append(
            template.format(
                name=names[i],
                issue=issue,
                issue_cap=_cap(issue),
                tried=tried,
                tried_cap=_cap(tried),
                ask=ask,
                priority=rng.choice(PRIORITY),
            )
        )
    # Interleave the three styles so neighbouring summary requests differ.
    return [text for triple in zip(news, products, tickets, strict=True) for text in triple]


# --------------------------------------------------------------------------------------------
# Customer reviews for classification, assembled from an opener and a topic/polarity sentence.
# --------------------------------------------------------------------------------------------

REVIEW_ITEMS = [
    "the wireless headphones", "the air fryer", "the electric toothbrush", "the baby monitor",
    "the smart watch", "the kitchen scale", "the robot vacuum", "the coffee grinder", "the e-reader",
    "the bluetooth speaker", "the fitness tracker", "the webcam", "the desk lamp", "the hair dryer",
    "the electric kettle", "the portable charger",
]

REVIEW_OPENERS = [
    "I bought {item} last month.",
    "Ordered {item} for my sister.",
    "Review of {item}:",
    "We have been using {item} for a few weeks now.",
    "Bought {item} from this store.",
    "Got {item} on sale.",
]

# (topic, polarity) -> hand-written review sentences.
REVIEW_CORES = {
    ("shipping", "positive"): [
        "It arrived two days early and the packaging was perfect.",
        "Delivery was fast and the courier even called ahead.",
        "Shipping was free and tracking updates were accurate the whole way.",
        "The parcel came the next morning, well wrapped and undamaged.",
    ],
    ("shipping", "negative"): [
        "The package arrived a week late and the box was crushed.",
        "Tracking said delivered, but nothing was at my door for three days.",
        "It was shipped to the wrong city and I had to pick it up myself.",
        "Delivery took almost a month and nobody could tell me why.",
    ],
    ("shipping", "neutral"): [
        "It arrived on the date that was promised, in a plain cardboard box.",
        "Delivery took about five working days, as stated on the website.",
    ],
    ("billing", "positive"): [
        "The price was exactly what was advertised and the refund for my old order came quickly.",
        "Checkout was simple and I liked being able to pay in three installments.",
        "They applied my coupon automatically, which saved me twenty dollars.",
        "Billing is clear and I got a proper invoice for my company right away.",
    ],
    ("billing", "negative"): [
        "I was charged twice and it took five emails to get my money back.",
        "Hidden fees at checkout added almost 30 percent to the price.",
        "They charged me for an extended warranty I never asked for.",
        "The invoice showed the wrong amount and nobody would correct it.",
    ],
    ("billing", "neutral"): [
        "The price is about the same as in other shops.",
        "Payment went through normally and the receipt arrived by email.",
    ],
    ("product_quality", "positive"): [
        "The build quality is excellent and it feels like it will last for years.",
        "The materials are sturdy and everything works exactly as described.",
        "It performs far better than I expected for the price.",
        "It is well made, with no loose parts or rough edges.",
    ],
    ("product_quality", "negative"): [
        "It stopped working after two weeks and the plastic already cracked.",
        "One of the buttons fell off the first time I used it.",
        "The battery barely lasts an hour, which is useless for me.",
        "It feels cheap and flimsy, nothing like the photos.",
    ],
    ("product_quality", "neutral"): [
        "The quality is about average, similar to the cheaper brands.",
        "It does what it says, no more and no less.",
    ],
    ("customer_service", "positive"): [
        "Support answered my question within ten minutes and was very friendly.",
        "The agent on the phone solved my problem and followed up the next day.",
        "When I had a question, the chat support explained everything patiently.",
        "Customer service replaced a missing part without asking any questions.",
    ],
    ("customer_service", "negative"): [
        "Customer service never replied to my three emails.",
        "The support agent was rude and hung up on me.",
        "I waited on hold for over an hour and was then transferred twice.",
        "Support kept sending copy-paste answers that ignored my actual problem.",
    ],
    ("customer_service", "neutral"): [
        "I contacted support once and got a standard reply after two days.",
        "The help desk answered my question, although the reply was brief.",
    ],
    ("usability", "positive"): [
        "Setting it up took five minutes and the controls are very intuitive.",
        "The companion app is clean and easy to use, even for my parents.",
        "The instructions are clear and every button does what you expect.",
        "It is simple to set up and I never had to read the manual.",
    ],
    ("usability", "negative"): [
        "The menus are confusing and it took me an hour to change a basic setting.",
        "The display is hard to read and the buttons are tiny.",
        "The quick-start guide was unreadable and two steps were missing.",
        "Pairing it with my phone fails almost every time.",
    ],
    ("usability", "neutral"): [
        "The setup is a bit long but the manual explains each step.",
        "The controls take some getting used to, like most devices of this type.",
    ],
}


def reviews(rng: random.Random) -> list[str]:
    cells = [(key, text) for key, texts in REVIEW_CORES.items() for text in texts]
    rng.shuffle(cells)
    out = []
    for i, (_key, core) in enumerate(cells[:48]):
        item = REVIEW_ITEMS[i % len(REVIEW_ITEMS)]
        opener = REVIEW_OPENERS[rng.randrange(len(REVIEW_OPENERS))].format(item=item)
        out.append(f"{_cap(opener)} {core}")
    return out


# --------------------------------------------------------------------------------------------
# Extraction: short invoices, receipts and emails with a name, a date and an amount.
# --------------------------------------------------------------------------------------------

EXTRACT_PEOPLE = [
    "Laura Schmidt", "Kofi Mensah", "Mateo Fernandez", "Anna Kowalska", "Rahul Mehta", "Sarah O'Neill",
    "Hiroshi Sato", "Elena Petrova", "David Cohen", "Amara Nwosu", "Lucia Moreno", "Jonas Berg",
    "Isabel Costa", "Omar Haddad", "Claire Dubois", "Ngozi Eze", "Peter Lindqvist", "Marco Bianchi",
    "Hannah Weiss", "Ivan Horvat", "Leila Farah", "Samuel Adeyemi", "Rosa Jimenez", "Thomas Meyer",
    "Mei Lin", "Nadia Rahman", "Victor Almeida", "Emily Chen",
]

EXTRACT_COMPANIES = [
    "Harbor Lane Bakery", "Blue Fern Studio", "Nordic Tile Co.", "Quickfix Plumbing", "Pine Street Dental",
    "Redwood Print Shop", "Summit IT Services", "Green Leaf Catering", "Clearview Optics",
    "Atlas Moving Ltd.", "Bright Path Tutoring", "Maple Court Cafe",
]

MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]

# (template, name is a person only, amount range in currency units)
EXTRACT_TEMPLATES = [
    ("INVOICE #{num}\nBilled to: {name}\nDate: {date}\nWeb design services, 12 hours\nTotal due: {amount}",
     False, (600, 2400)),
    ("Subject: Payment reminder\n\nDear {name},\nour records show that invoice {num}, issued on {date}, "
     "is still unpaid. The outstanding balance is {amount}. Please pay within 14 days.\n\nAccounts team",
     False, (90, 3000)),
    ("RECEIPT\nStore {store} - {date}\nCustomer: {name}\n2 x coffee beans 1kg\n1 x milk frother\n"
     "TOTAL {amount}\nPaid by card. Thank you!", False, (45, 140)),
    ("Hi,\n\nThis is {name}. I'd like to be reimbursed for the client dinner on {date}. "
     "The bill came to {amount}; the receipt is attached.\n\nThanks", True, (60, 480)),
    ("Refund confirmation\nWe have refunded {amount} to {name} for order {num}. "
     "The refund was processed on {date} and may take 5 business days to appear.", False, (15, 900)),
    ("From: {name}\nSent: {date}\n\nHello, we accept your quote of {amount} for the office move. "
     "Please confirm the truck booking.\n\nBest regards", False, (800, 5000)),
    ("Rent receipt\nReceived from {name} the sum of {amount} for the rent of unit 4B, "
     "period ending {date}.\nSigned, the landlord", True, (650, 2400)),
    ("Your subscription has been renewed!\nAccount holder: {name}\nRenewal date: {date}\n"
     "Plan: Premium annual\nAmount charged: {amount}", False, (49, 499)),
]


def _date(rng: random.Random) -> str:
    year = rng.choice([2023, 2024])
    month = rng.randint(1, 12)
    day = rng.randint(1, 28)
    style = rng.randrange(3)
    if style == 0:
        return f"{MONTHS[month - 1]} {day}, {year}"
    if style == 1:
        return f"{year}-{month:02d}-{day:02d}"
    return f"{day} {MONTHS[month - 1]} {year}"


def _amount(rng: random.Random, low: int, high: int) -> str:
    value = rng.randint(low * 100, high * 100) / 100
    currency = rng.choice(["$", "EUR ", "GBP ", "$"])
    return f"{currency}{value:,.2f}"


def extractions(rng: random.Random) -> list[str]:
    pool = EXTRACT_PEOPLE + EXTRACT_COMPANIES
    rng.shuffle(pool)
    out = []
    for i in range(40):
        template, person_only, (low, high) = EXTRACT_TEMPLATES[i % len(EXTRACT_TEMPLATES)]
        name = next(n for n in pool if n in EXTRACT_PEOPLE) if person_only else pool[0]
        pool.remove(name)
        num = rng.randint(10000, 99999)
        out.append(
            template.format(
                name=name, date=_date(rng), amount=_amount(rng, low, high), num=num, store=100 + num % 900
            )
        )
    return out


# --------------------------------------------------------------------------------------------
# Translation.
# --------------------------------------------------------------------------------------------

EN_FR = [
    "Good morning, could you tell me where the train station is?",
    "The meeting has been moved to Thursday at three o'clock.",
    "I would like a table for two by the window, please.",
    "Our store is closed on Sundays and public holidays.",
    "Please remember to bring your passport to the airport.",
    "The weather will be sunny tomorrow, with a light breeze in the afternoon.",
    "Thank you for your order; it will be shipped within two days.",
    "My brother works as a nurse at the city hospital.",
    "How much does a ticket to the museum cost?",
    "We are looking for a small apartment near the university.",
    "The children are playing in the garden after school.",
    "Can you send me the report before the end of the day?",
    "This soup is delicious; what is the recipe?",
    "The library opens at nine and closes at six.",
    "I have been learning French for two years.",
    "Turn left at the bakery and continue straight for two hundred meters.",
    "The price includes breakfast and free Wi-Fi.",
    "Our flight was delayed because of the snow.",
    "She bought fresh vegetables at the market this morning.",
    "Please call me back when you have a moment.",
]

EN_ES = [
    "Where is the nearest pharmacy?",
    "I need to change my reservation to next Friday.",
    "The museum is free for students on Wednesdays.",
    "We had dinner with our friends at a small restaurant by the sea.",
    "Your package will arrive between nine and noon.",
    "My phone battery is almost empty; can I charge it here?",
    "The bus to the city center leaves every fifteen minutes.",
    "I am allergic to nuts, so please check the ingredients.",
    "Our team finished the project two days ahead of schedule.",
    "It is raining, so take an umbrella with you.",
    "The hotel room was clean and the staff were very kind.",
    "How long does it take to walk to the beach?",
    "I would like to open a savings account.",
    "My grandmother grows tomatoes and peppers in her garden.",
    "The concert starts at eight, but the doors open at seven.",
    "Please write your name and address on the form.",
    "He runs five kilometers every morning before work.",
    "Could you speak a little more slowly, please?",
]

ZH_EN = [
    "今天天气很好，我们去公园散步吧。",
    "请问最近的地铁站在哪里？",
    "我每天早上七点起床，然后去上班。",
    "这家餐厅的饺子非常好吃。",
    "会议推迟到下周一上午十点。",
    "我的手机没电了，可以借用一下你的充电器吗？",
    "北京是中国的首都，也是一座历史悠久的城市。",
    "他正在学习如何用 Python 编程。",
    "请在周五之前把报告发给我。",
    "这件衣服太贵了，有没有便宜一点的？",
    "我们的航班因为大雾延误了两个小时。",
    "周末我打算和家人一起去爬山。",
    "图书馆晚上九点关门。",
    "谢谢你的帮助，我非常感激。",
    "这个城市的公共交通非常方便。",
    "孩子们在学校学习数学、语文和英语。",
    "你能推荐一本好看的小说吗？",
    "春节是中国最重要的传统节日。",
]


def _translate_tokens(text: str, chinese: bool) -> int:
    units = len(text) if chinese else len(text.split())
    return max(32, min(72, units * (2 if chinese else 3)))


# --------------------------------------------------------------------------------------------
# Assembly.
# --------------------------------------------------------------------------------------------


def _request(custom_id: str, system: str, user: str, max_tokens: int) -> dict:
    assert 24 <= max_tokens <= 96, (custom_id, max_tokens)
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": URL,
        "body": {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": SYSTEM[system]},
                {"role": "user", "content": user},
            ],
            "max_tokens": max_tokens,
            "temperature": 0,
        },
    }


def build() -> list[dict]:
    rng = random.Random(SEED)
    qa = [_request(f"qa-{i:03d}", "qa", q, n) for i, (q, n) in enumerate(qa_questions(rng), 1)]
    summary = [_request(f"summary-{i:03d}", "summary", t, 64) for i, t in enumerate(summaries(rng), 1)]
    texts = reviews(rng)
    sentiment = [
        _request(f"classify-sentiment-{i:03d}", "classify-sentiment", t, 24) for i, t in enumerate(texts[:24], 1)
    ]
    topic = [_request(f"classify-topic-{i:03d}", "classify-topic", t, 24) for i, t in enumerate(texts[24:], 1)]
    extract = [_request(f"extract-{i:03d}", "extract", t, 64) for i, t in enumerate(extractions(rng), 1)]
    translations = []
    for task, sources, chinese in (
        ("translate-fr", EN_FR, False),
        ("translate-es", EN_ES, False),
        ("translate-zh", ZH_EN, True),
    ):
        translations += [
            _request(f"{task}-{i:03d}", task, t, _translate_tokens(t, chinese)) for i, t in enumerate(sources, 1)
        ]

    # The well-known questions open the file; the rest is a seeded mix of every task.
    head, rest = qa[: len(QA_FIRST)], qa[len(QA_FIRST) :]
    rest += summary + sentiment + topic + extract + translations
    rng.shuffle(rest)
    requests = head + rest
    assert len(requests) == 240, len(requests)
    assert len({r["custom_id"] for r in requests}) == 240
    return requests


def main() -> None:
    requests = build()
    lines = [json.dumps(r, ensure_ascii=False) + "\n" for r in requests]
    OUT.write_text("".join(lines), encoding="utf-8", newline="\n")
    total = sum(r["body"]["max_tokens"] for r in requests)
    print(f"wrote {len(lines)} requests to {OUT} ({OUT.stat().st_size} bytes, max_tokens total {total})")


if __name__ == "__main__":
    main()
