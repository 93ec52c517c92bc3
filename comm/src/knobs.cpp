#include "knobs.hpp"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>

#include "meshmem/error.hpp"

namespace meshmem::detail {

namespace {
// Filled by the knobs' constructors during static initialisation (a function-local
// static, so that it exists before the first knob of any translation unit registers).
std::vector<const Knob*>& registry() {
  static std::vector<const Knob*> knobs;
  return knobs;
}
}  // namespace

Knob::Knob(const char* group, const char* name, const char* doc, bool must_agree)
    : group_(group), name_(name), doc_(doc), must_agree_(must_agree) {
  registry().push_back(this);
}

std::vector<const Knob*> knob_table() {
  std::vector<const Knob*> table = registry();
  std::stable_sort(table.begin(), table.end(), [](const Knob* a, const Knob* b) {
    const bool ca = std::strcmp(a->group(), "core") == 0, cb = std::strcmp(b->group(), "core") == 0;
    if (ca != cb) return ca;
    if (ca) return false;  // core knobs: one file, in declaration order
    const int g = std::strcmp(a->group(), b->group());
    return g != 0 ? g < 0 : std::strcmp(a->name(), b->name()) < 0;
  });
  return table;
}

const Knob* find_knob(const std::string& name) {
  for (const Knob* k : registry())
    if (name == k->name()) return k;
  return nullptr;
}

void bad_knob_value(const char* name, const std::string& raw, const std::string& expected) {
  throw Error(ErrorCode::InvalidArgument, std::string(name) + "='" + raw + "' is not valid: expected " + expected);
}

std::string lower_trimmed(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return {};
  const auto e = s.find_last_not_of(" \t");
  std::string t = s.substr(b, e - b + 1);
  for (char& c : t) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return t;
}

std::size_t parse_bytes(const char* name, const std::string& raw) {
  const std::string t = lower_trimmed(raw);
  char* end = nullptr;
  const unsigned long long n = std::strtoull(t.c_str(), &end, 10);
  if (t.empty() || t[0] == '-' || *end != '\0' || n > (1ull << 40)) bad_knob_value(name, raw, "a byte count");
  return static_cast<std::size_t>(n);
}

std::string print_number(const std::size_t& n) { return std::to_string(n); }

std::chrono::microseconds parse_micros(const char* name, const std::string& raw, std::chrono::microseconds max) {
  const std::string t = lower_trimmed(raw);
  const std::string expected = "a time with its unit, such as 250us or 2ms (at most " + print_micros(max) + "), or 0";
  std::size_t digits = 0;
  while (digits < t.size() && std::isdigit(static_cast<unsigned char>(t[digits]))) ++digits;
  if (digits == 0 || digits > 9) bad_knob_value(name, raw, expected);
  const long long n = std::stoll(t.substr(0, digits));
  const std::string unit = t.substr(digits);
  long long us = 0;
  if (unit == "us") us = n;
  else if (unit == "ms") us = n * 1000;
  else if (unit.empty() && n == 0) us = 0;
  else bad_knob_value(name, raw, expected);
  if (us > max.count()) bad_knob_value(name, raw, expected);
  return std::chrono::microseconds(us);
}

std::string print_micros(const std::chrono::microseconds& t) {
  const long long us = t.count();
  if (us == 0) return "0";
  return us % 1000 == 0 ? std::to_string(us / 1000) + "ms" : std::to_string(us) + "us";
}

}  // namespace meshmem::detail
