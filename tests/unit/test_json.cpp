// Reading JSON text safely: nesting bounded before parsing (copying or printing a deep value overflowed the
// stack), parse errors without nlohmann's prefix, values echoed as short excerpts, --set values checked, and
// integers outside int64 refused instead of wrapped.
#include <gtest/gtest.h>

#include "core/config_reader.h"
#include "core/json.h"
#include "util/test_util.h"

namespace tessera {
namespace {

std::string nested(int depth) { return std::string(size_t(depth), '[') + std::string(size_t(depth), ']'); }

TEST(Json, NestingIsBoundedBeforeParsing) {
    EXPECT_NO_THROW(parse_json(nested(kMaxJsonDepth), "x.json"));
    test::expect_error([] { parse_json(nested(kMaxJsonDepth + 1), "x.json"); },
                       "x.json: JSON nested deeper than 64 levels");
    test::expect_error([] { parse_json("{\"a\": " + nested(300000) + "}", "x.json"); }, "nested deeper");
    // brackets inside strings do not count; escaped quotes do not end a string
    EXPECT_NO_THROW(parse_json("[\"" + std::string(1000, '[') + "\\\"" + std::string(1000, '{') + "\"]", "x.json"));
}

TEST(Json, ParseErrorsNameTheSourceWithoutTheLibraryPrefix) {
    try {
        parse_json("{\"a\": 1,, }", "cfg.json");
        ADD_FAILURE();
    } catch (const Error& e) {
        const std::string m = e.what();
        EXPECT_EQ(m.rfind("cfg.json: not valid JSON: ", 0), 0u) << m;
        EXPECT_EQ(m.find("json.exception"), std::string::npos) << m;
        EXPECT_NE(m.find("line 1"), std::string::npos) << m;
    }
    // a megabyte-long bad token is not echoed whole
    try {
        parse_json("\"" + std::string(1 << 20, 'x') + "\x01\"", "big.json");
        ADD_FAILURE();
    } catch (const Error& e) {
        EXPECT_LT(std::string(e.what()).size(), 400u);
    }
}

TEST(Json, ExcerptsAreShortAndOneLine) {
    EXPECT_EQ(excerpt("abc"), "abc");
    EXPECT_EQ(excerpt(std::string(100, 'x'), 10), "xxxxxxxxxx… (90 more bytes)");
    EXPECT_EQ(excerpt("a\nb\x01"), "a\\nb\\x01");
    EXPECT_EQ(excerpt("\xc3\xa9\xc3\xa9", 3), "\xc3\xa9… (2 more bytes)");  // never half a UTF-8 character
    EXPECT_EQ(json_excerpt(Json("\xff")), "\"\xef\xbf\xbd\"");              // invalid UTF-8 replaced, no throw
}

TEST(ConfigReader, IntegersOutsideInt64AreRefusedNotWrapped) {
    for (const char* v : {"18446744073709551615", "9223372036854775808", "1e30", "-1e19"}) {
        const Json doc = parse_json(std::string("{\"n\": ") + v + "}", "c");
        ConfigReader r(doc, "c.json: model");
        test::expect_error([&] { r.integer("n", 0); }, "model.n = ");
    }
    const Json ok = parse_json("{\"n\": 9223372036854775807, \"m\": 4.0}", "c");
    ConfigReader r(ok, "c.json: model");
    EXPECT_EQ(r.integer("n", 0), INT64_MAX);
    EXPECT_EQ(r.integer("m", 0), 4);
}

TEST(ConfigReader, MessagesEchoValuesAsExcerpts) {
    const Json doc = Json{{"lr", std::string(1 << 20, 'x')}, {std::string(1 << 20, 'k'), 1}};
    ConfigReader r(doc, "c.json: train");
    try {
        r.number("lr", 1.0);
        ADD_FAILURE();
    } catch (const Error& e) {
        EXPECT_LT(std::string(e.what()).size(), 300u);
    }
    try {
        r.finish();
        ADD_FAILURE();
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("unknown key"), std::string::npos);
        EXPECT_LT(std::string(e.what()).size(), 300u);
    }
}

TEST(ApplyOverride, ValuesAreCheckedLikeFiles) {
    Json doc = Json::object();
    test::expect_error([&] { apply_override(doc, "model.x=" + nested(300000)); }, "--set model.x: JSON nested deeper");
    test::expect_error([&] { apply_override(doc, "data.path=\xff\xfe"); }, "not valid UTF-8");
    Json null_doc;  // a config file holding `null`
    test::expect_error([&] { apply_override(null_doc, "train.steps=1"); }, "the config is not a JSON object");
    apply_override(doc, "train.steps=5");
    EXPECT_EQ(doc["train"]["steps"], 5);
}

}  // namespace
}  // namespace tessera
