// Errors for people: library code throws tessera::Error with a message that says what was wrong and
// where; apps/ turn it into one line and a non-zero exit. Library code never calls exit or abort.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace tessera {

class Error : public std::runtime_error {
  public:
    // message: what a user reads; origin: source file:line and failing expression, for developers
    explicit Error(std::string message, std::string origin = {})
        : std::runtime_error(std::move(message)), origin_(std::move(origin)) {}
    const std::string& origin() const { return origin_; }

  private:
    std::string origin_;
};

}  // namespace tessera

#define TESSERA_STRINGIFY_(x) #x
#define TESSERA_STRINGIFY(x) TESSERA_STRINGIFY_(x)

// TESSERA_CHECK(cond, "fmt {}", args...): throws tessera::Error(formatted message) when cond is false.
#define TESSERA_CHECK(cond, ...)                                                                       \
    do {                                                                                               \
        if (!(cond)) [[unlikely]] {                                                                    \
            throw ::tessera::Error(::fmt::format(__VA_ARGS__),                                         \
                                   __FILE__ ":" TESSERA_STRINGIFY(__LINE__) ": check failed: " #cond); \
        }                                                                                              \
    } while (0)

#define TESSERA_FAIL(...) throw ::tessera::Error(::fmt::format(__VA_ARGS__), __FILE__ ":" TESSERA_STRINGIFY(__LINE__))
