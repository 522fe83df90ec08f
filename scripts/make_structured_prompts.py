"""Writes specula/data/structured/prompts.jsonl: 24 structured-output prompts with their JSON schemas,
written for specula (none from a benchmark). Run from the repository root."""
import json
S = lambda n=48: {"type": "string", "maxLength": n}
def obj(props, req=None):
    return {"type": "object", "properties": props, "required": req or list(props), "additionalProperties": False}
rows = []
def add(cat, text, schema):
    rows.append({"id": f"s{len(rows)+1:02d}", "category": cat, "turns": [text], "schema": schema})

# extraction from a given passage
person = obj({"name": S(), "role": S(), "company": S(), "city": S()})
add("extraction", "Read the note and return the person's name, role, company and city as JSON.\n\nNote: Maria Alvarez joined Northwind Logistics in March as head of procurement. She works from the Valencia office and reports to the COO.", person)
add("extraction", "Extract the contact as JSON (name, role, company, city).\n\nSigned: Dr. Kenji Watanabe, Senior Research Engineer, Hoshino Robotics, Osaka.", person)
order = obj({"order_id": S(16), "items": {"type": "array", "items": obj({"product": S(40), "quantity": {"type": "integer", "minimum": 1, "maximum": 100}}), "maxItems": 4}, "total_eur": {"type": "number"}})
add("extraction", "Turn this order confirmation into JSON with order_id, the items (product, quantity) and total_eur.\n\nOrder A-2291: 2 x USB-C cable, 1 x laptop stand, 3 x notebook. Total: 64.50 EUR.", order)
add("extraction", "Extract order_id, items (product, quantity) and total_eur as JSON.\n\nWe confirm order 7781-B: one espresso machine and two boxes of descaling tablets, for 219.90 EUR in total.", order)
event = obj({"title": S(60), "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}, "location": S(), "speakers": {"type": "array", "items": S(40), "maxItems": 4}})
add("extraction", "Give the event as JSON: title, date (YYYY-MM-DD), location and speakers.\n\nThe Rust in Production meetup takes place on 14 May 2025 at the Kulturhaus in Leipzig, with talks by Anna Berg and Tom Kowalski.", event)
add("extraction", "Return JSON with title, date (YYYY-MM-DD), location and speakers for this announcement.\n\nJoin us on 2 October 2024 in Room 4B of the city library for 'Gardening on Balconies', presented by Lena Fischer.", event)

# function-call arguments
weather = obj({"location": S(), "unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}})
add("function_call", "You can call get_forecast(location, unit, days). Write the JSON arguments for: what will the weather be like in Lisbon over the next three days, in celsius?", weather)
add("function_call", "Arguments for get_forecast(location, unit, days) as JSON, for the request: 'Show me a 5 day forecast for Denver in fahrenheit.'", weather)
email = obj({"to": {"type": "array", "items": S(60), "maxItems": 3}, "subject": S(60), "body": S(200)})
add("function_call", "Call send_email(to, subject, body). Give the JSON arguments to tell sam@example.org that the meeting moves to Thursday at 10.", email)
add("function_call", "Produce the JSON arguments of send_email(to, subject, body) to thank ops@example.com and it@example.com for fixing the VPN.", email)
search = obj({"query": S(80), "max_results": {"type": "integer", "minimum": 1, "maximum": 50}, "sort": {"enum": ["relevance", "date", "price"]}, "filters": obj({"min_price": {"type": "number"}, "max_price": {"type": "number"}})})
add("function_call", "Translate into JSON arguments for search_products(query, max_results, sort, filters{min_price, max_price}): 'cheapest wireless headphones between 20 and 60 dollars, show 10'.", search)
add("function_call", "JSON arguments for search_products(query, max_results, sort, filters{min_price, max_price}) for: 'newest trail running shoes up to 150, five results, at least 40'.", search)

# lists of records
people = {"type": "array", "items": obj({"name": S(40), "age": {"type": "integer", "minimum": 0, "maximum": 120}}), "minItems": 1, "maxItems": 4}
add("records", "List the people in this sentence as a JSON array of {name, age}.\n\nAt the reunion were Priya (34), her brother Arjun (29) and their grandmother Lakshmi, who just turned 81.", people)
add("records", "Return a JSON array of {name, age} for: Oliver is 12, his sister Mia is 9, and their cousin Noah is 15.", people)
books = {"type": "array", "items": obj({"title": S(60), "author": S(40), "year": {"type": "integer", "minimum": 1000, "maximum": 2030}}), "minItems": 1, "maxItems": 4}
add("records", "Give a JSON array of {title, author, year} for three classic science fiction novels.", books)
add("records", "Make a JSON array of {title, author, year} with two well-known books about programming.", books)

# nested objects
company = obj({"name": S(), "founded": {"type": "integer", "minimum": 1800, "maximum": 2030}, "headquarters": obj({"city": S(), "country": S()}), "products": {"type": "array", "items": S(40), "maxItems": 3}})
add("nested", "Describe this company as JSON with name, founded, headquarters {city, country} and products.\n\nBlue Fjord Audio was founded in 2009 in Bergen, Norway. It makes studio monitors, headphones and audio interfaces.", company)
add("nested", "As JSON (name, founded, headquarters {city, country}, products): Verde Cycles, a bicycle maker from Porto, Portugal, started in 1994 and sells city bikes and cargo bikes.", company)
recipe = obj({"dish": S(), "servings": {"type": "integer", "minimum": 1, "maximum": 12}, "ingredients": {"type": "array", "items": obj({"item": S(30), "amount": S(20)}), "maxItems": 5}, "vegetarian": {"type": "boolean"}})
add("nested", "Write a simple pancake recipe for 2 servings as JSON: dish, servings, ingredients [{item, amount}], vegetarian.", recipe)
add("nested", "Give a tomato soup recipe as JSON with dish, servings, ingredients [{item, amount}] and vegetarian.", recipe)

# enums / classification
ticket = obj({"category": {"enum": ["billing", "technical", "account", "other"]}, "priority": {"enum": ["low", "medium", "high"]}, "summary": S(80)})
add("classification", "Classify this support ticket as JSON (category, priority, summary).\n\nTicket: 'I was charged twice for my March subscription, please refund one payment as soon as possible.'", ticket)
add("classification", "Classify as JSON (category, priority, summary): 'The app crashes every time I open the settings page on Android 14.'", ticket)
review = obj({"sentiment": {"enum": ["positive", "neutral", "negative"]}, "aspects": {"type": "array", "items": {"enum": ["price", "quality", "delivery", "service"]}, "maxItems": 4}, "stars": {"type": "integer", "minimum": 1, "maximum": 5}})
add("classification", "Analyse the review as JSON with sentiment, aspects and stars.\n\nReview: 'Arrived a week late and the box was damaged, but the kettle itself works well for the price.'", review)
add("classification", "Give sentiment, aspects and stars as JSON for: 'Friendly staff, fast delivery, excellent build quality. Worth every cent.'", review)
assert len(rows) == 24
with open("specula/data/structured/prompts.jsonl", "w") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")
