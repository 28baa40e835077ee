"""Writes tests/data/catalogue.csv: a product catalogue for the item-encoder ranking set (issue 34).

    python tests/data/make_catalogue.py          (rewrites the file; seeded, so the same bytes)

Titles are put together from the hand-written word lists below (types, cuts, materials, colours,
brands and details per category; English, simplified Chinese and a few code-mixed), one seeded
draw each: shop-style titles with a short description, about 15 tokens each. Categories cover the
seed labels' clothing and what intent_dev calls Other (outerwear, shoes, bags, accessories,
sportswear, home, electronics, beauty, pets), so its queries have relevant and irrelevant items.
"""
from __future__ import annotations

import csv
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent / "catalogue.csv"
COLORS = ["black", "white", "navy", "beige", "olive", "burgundy", "light blue", "grey", "camel",
          "pink", "red", "cream", "forest green", "charcoal", "mustard"]
ZH_COLORS = ["黑色", "白色", "藏青", "米色", "军绿", "酒红", "浅蓝", "灰色", "驼色", "粉色", "红色", "奶白"]
BRANDS = ["Uniqlo", "Zara", "H&M", "Levi's", "Mango", "COS", "Gap", "Everlane", "Muji", "Nike",
          "Adidas", "Patagonia", "Ralph Lauren", "Burberry", "Aritzia", "Madewell", "J.Crew", "Shein"]
ZH_BRANDS = ["优衣库", "太平鸟", "波司登", "李宁", "安踏", "森马", "江南布衣", "ONLY", "UR", "海澜之家"]
WHO = ["women's", "men's", "unisex", "women's", "men's", "kids'"]
# Goods that are not clothing: their own brands, no colour and no wearer in the title.
GOODS = {"tech": ["Anker", "Apple", "Sony", "Xiaomi", "Logitech", "Belkin", "JBL"],
         "beauty": ["L'Oreal", "Clinique", "The Ordinary", "Shiseido", "Nivea", "Dior", "CeraVe"],
         "home": ["IKEA", "Muji", "Le Creuset", "Lodge", "Zara Home", "Yankee Candle"],
         "pets": ["Ruffwear", "Kong", "PetSafe", "Hurtta"],
         "craft": ["Drops", "Simplicity", "DMC", "Rowan"]}

# category: (label, English types, English attributes, details, Chinese types, Chinese attributes, count)
CATS = {
    "dress": ("Dress", ["midi dress", "maxi dress", "wrap dress", "slip dress", "shirt dress",
                        "sundress", "bodycon dress", "cocktail dress", "sweater dress"],
              ["floral", "satin", "linen", "pleated", "v-neck", "puff sleeve", "smocked", "tiered"],
              ["tie waist", "side slit", "lined", "adjustable straps", "A-line skirt", "knee length"],
              ["连衣裙", "碎花连衣裙", "吊带裙", "法式长裙", "针织连衣裙"], ["收腰", "雪纺", "复古", "气质"], 34),
    "jeans": ("Jeans", ["straight leg jeans", "skinny jeans", "wide leg jeans", "bootcut jeans",
                        "mom jeans", "slim fit jeans", "relaxed jeans", "selvedge jeans"],
              ["high rise", "mid rise", "stretch", "distressed", "raw denim", "stonewash", "dark wash"],
              ["five pocket", "button fly", "cropped hem", "100% cotton denim", "zip fly", "ankle length"],
              ["牛仔裤", "直筒牛仔裤", "阔腿牛仔裤", "破洞牛仔裤"], ["高腰", "弹力", "宽松", "显瘦"], 32),
    "shirt": ("Shirt", ["oxford shirt", "button-down shirt", "linen shirt", "flannel shirt",
                        "dress shirt", "denim shirt", "chambray shirt", "silk blouse", "polo shirt"],
              ["long sleeve", "short sleeve", "slim fit", "relaxed fit", "striped", "checked"],
              ["spread collar", "chest pocket", "non-iron", "mother-of-pearl buttons", "curved hem"],
              ["衬衫", "白衬衫", "格子衬衫", "雪纺衬衫"], ["长袖", "免烫", "商务", "宽松"], 30),
    "trench": ("Trench Coat", ["trench coat", "double-breasted trench", "belted trench coat",
                               "cropped trench", "mac coat"],
               ["classic", "water-resistant", "cotton gabardine", "oversized", "longline"],
               ["storm flap", "removable belt", "epaulettes", "check lining", "knee length"],
               ["风衣", "风衣外套", "中长款风衣"], ["双排扣", "英伦", "收腰", "防泼水"], 24),
    "skirt": ("Skirt", ["pleated skirt", "midi skirt", "mini skirt", "denim skirt", "slip skirt",
                        "a-line skirt", "pencil skirt", "tennis skirt", "wrap skirt"],
              ["satin", "tweed", "corduroy", "high waisted", "leather-look", "plaid"],
              ["side zip", "elastic waist", "lined", "front slit", "built-in shorts"],
              ["半身裙", "百褶裙", "A字裙", "包臀裙", "牛仔半身裙"], ["高腰", "垂感", "学院风", "显瘦"], 30),
    "tshirt": ("T-shirt", ["crew neck t-shirt", "v-neck tee", "graphic tee", "pocket tee",
                           "oversized tee", "boxy cropped tee", "long sleeve tee", "ringer tee"],
               ["organic cotton", "heavyweight", "slub jersey", "vintage wash", "slim", "printed"],
               ["ribbed collar", "pre-shrunk", "drop shoulder", "180 gsm", "tagless"],
               ["T恤", "短袖T恤", "纯棉T恤", "印花T恤"], ["纯棉", "宽松", "圆领", "情侣款"], 32),
    "hoodie": ("Hoodie", ["pullover hoodie", "zip-up hoodie", "fleece hoodie", "cropped hoodie",
                          "oversized hoodie", "sherpa-lined hoodie"],
               ["brushed fleece", "heavyweight", "garment-dyed", "logo", "tech fleece"],
               ["kangaroo pocket", "drawstring hood", "ribbed cuffs", "full zip", "thumb holes"],
               ["卫衣", "连帽卫衣", "加绒卫衣", "拉链卫衣"], ["加绒", "宽松", "情侣", "潮牌"], 28),
    "knit": ("Knitwear", ["cardigan", "crewneck sweater", "turtleneck sweater", "cable knit sweater",
                          "sweater vest", "mohair jumper", "knit polo", "v-neck pullover"],
             ["merino wool", "cashmere", "chunky knit", "ribbed", "alpaca blend", "cotton knit"],
             ["button front", "relaxed fit", "fine gauge", "dropped shoulders", "hand wash"],
             ["毛衣", "针织开衫", "羊绒衫", "高领毛衣", "针织背心"], ["羊毛", "慵懒风", "软糯", "加厚"], 30),
    "outer": ("Other", ["puffer jacket", "bomber jacket", "denim jacket", "wool overcoat",
                        "leather jacket", "rain jacket", "fleece vest", "down parka", "blazer"],
              ["lightweight", "insulated", "waterproof", "cropped", "oversized", "quilted"],
              ["hooded", "zip pockets", "packable", "two-button", "faux fur trim"],
              ["羽绒服", "冲锋衣", "牛仔外套", "西装外套", "大衣"], ["长款", "加厚", "防风", "短款"], 30),
    "shoes": ("Other", ["running shoes", "sneakers", "ankle boots", "loafers", "sandals",
                        "chelsea boots", "dress shoes", "hiking boots", "ballet flats", "slippers"],
              ["leather", "suede", "mesh", "cushioned", "waterproof", "platform", "lightweight"],
              ["rubber sole", "slip-on", "lace-up", "arch support", "breathable lining"],
              ["运动鞋", "板鞋", "马丁靴", "凉鞋", "乐福鞋"], ["透气", "防滑", "增高", "真皮"], 32),
    "bags": ("Other", ["crossbody bag", "tote bag", "backpack", "leather wallet", "belt bag",
                       "duffel bag", "clutch", "laptop bag"],
             ["vegan leather", "canvas", "nylon", "quilted", "mini"],
             ["adjustable strap", "zip closure", "card slots", "padded sleeve", "magnetic snap"],
             ["双肩包", "托特包", "斜挎包", "钱包"], ["大容量", "真皮", "通勤", "轻便"], 22),
    "acc": ("Other", ["baseball cap", "beanie", "wool scarf", "leather belt", "sunglasses",
                      "bucket hat", "silk scarf", "gloves", "watch", "earrings"],
            ["cashmere", "polarized", "sterling silver", "knitted", "classic", "minimalist"],
            ["one size", "gift box", "adjustable", "UV400", "hypoallergenic"],
            ["棒球帽", "羊绒围巾", "毛线帽", "皮带", "墨镜"], ["百搭", "保暖", "情侣", "复古"], 28),
    "sport": ("Other", ["leggings", "sports bra", "running shorts", "track pants", "yoga pants",
                        "tank top", "swimsuit", "cycling jersey", "joggers", "tennis polo"],
              ["high waisted", "moisture-wicking", "seamless", "quick-dry", "compression"],
              ["side pockets", "reflective details", "4-way stretch", "UPF 50", "squat proof"],
              ["瑜伽裤", "运动内衣", "速干短裤", "泳衣", "打底裤"], ["高弹", "速干", "显瘦", "专业"], 30),
    "sleep": ("Other", ["pajama set", "boxer briefs", "socks", "bralette", "robe", "thermal top"],
              ["silk", "cotton", "bamboo", "modal", "fleece"],
              ["pack of 3", "elastic waistband", "soft touch", "button front", "tagless"],
              ["睡衣", "内裤", "袜子", "保暖内衣"], ["纯棉", "冰丝", "家居", "加绒"], 18),
    "home": ("Other", ["duvet cover", "throw blanket", "ceramic mug", "cast iron skillet",
                       "scented candle", "bath towel set", "desk lamp", "chef's knife", "storage baskets"],
             ["linen", "stoneware", "organic cotton", "handmade", "non-stick"],
             ["queen size", "dishwasher safe", "set of 4", "soy wax", "USB charging"],
             ["四件套", "保温杯", "收纳盒", "香薰蜡烛", "毛巾"], ["纯棉", "北欧风", "家用", "大号"], 26),
    "tech": ("Other", ["wireless earbuds", "iphone 15 case", "phone charger", "bluetooth speaker",
                       "smartwatch", "laptop stand", "mechanical keyboard", "power bank", "usb-c cable"],
             ["noise cancelling", "fast charging", "magsafe", "waterproof", "aluminium"],
             ["20000mAh", "type-c", "2-year warranty", "30h battery", "shockproof"],
             ["蓝牙耳机", "充电宝", "手机壳", "数据线", "智能手表"], ["快充", "降噪", "超薄", "大容量"], 26),
    "beauty": ("Other", ["lipstick", "moisturizer", "sunscreen SPF 50", "face serum", "sheet mask",
                         "shampoo", "perfume", "foundation"],
               ["hydrating", "matte", "vitamin C", "fragrance-free", "long-lasting"],
               ["for dry skin", "30 ml", "dermatologist tested", "cruelty free", "travel size"],
               ["口红", "面膜", "防晒霜", "精华液", "洗发水"], ["补水", "保湿", "哑光", "敏感肌"], 22),
    "pets": ("Other", ["dog hoodie", "dog harness", "cat tree", "pet bed", "dog raincoat"],
             ["fleece", "reflective", "waterproof", "orthopedic"],
             ["small breeds", "machine washable", "adjustable", "non-slip base"],
             ["狗狗卫衣", "猫爬架", "宠物窝"], ["保暖", "可拆洗"], 12),
    "craft": ("Other", ["knitting yarn", "dress sewing pattern", "embroidery kit", "fabric bundle"],
              ["merino", "beginner", "cotton", "chunky"],
              ["100 g skein", "sizes 6-20", "printed instructions", "fat quarters"],
              ["毛线", "刺绣套装", "布料"], ["手工", "粗毛线"], 10),
}


def title(rng: random.Random, name: str, cat) -> str:
    _, types, attrs, details, zh_types, zh_attrs, _ = cat
    goods = GOODS.get(name)
    r = rng.random()
    if r < 0.25:  # simplified Chinese, shop style
        colour = "" if goods else rng.choice(ZH_COLORS)
        return (f"{rng.choice(ZH_BRANDS)}{rng.choice(zh_attrs)}{colour}{rng.choice(zh_types)}"
                f" {rng.choice(zh_attrs)}{rng.choice(['新款', '春秋', '夏季', '冬季', '2024'])}")
    if goods:
        head = f"{rng.choice(goods)} {rng.choice(attrs)} {rng.choice(types)}"
    else:
        who = rng.choice(WHO) if cat[0] != "Other" or rng.random() < 0.5 else ""
        head = " ".join(x for x in (rng.choice(BRANDS), who, rng.choice(attrs), rng.choice(COLORS),
                                    rng.choice(types)) if x)
    d1, d2 = rng.sample(details, 2)
    if r < 0.32:  # code-mixed: an English title with a Chinese attribute
        return f"{head} {rng.choice(zh_attrs)}, {d1}"
    return f"{head} - {d1}, {d2}"


def main() -> None:
    rng = random.Random(34)
    rows, seen = [], set()
    for name, cat in CATS.items():
        n = 0
        while n < cat[-1]:
            t = title(rng, name, cat)
            if t.lower() in seen:
                continue
            seen.add(t.lower())
            n += 1
            rows.append((name, cat[0], t))
    rng.shuffle(rows)
    with open(OUT, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["id", "category", "label", "text"])
        for i, (name, label, t) in enumerate(rows):
            w.writerow([f"sku-{i:04d}", name, label, t])
    print(f"{OUT}: {len(rows)} items")


if __name__ == "__main__":
    main()
