// JsonWriter: just enough JSON for meshmem-info --json (objects, arrays, strings, numbers,
// booleans, null), with commas and string escapes handled in one place.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace meshmem::info {

class JsonWriter {
 public:
  JsonWriter& begin_object() { return open('{'); }
  JsonWriter& end_object() { return close('}'); }
  JsonWriter& begin_array() { return open('['); }
  JsonWriter& end_array() { return close(']'); }
  // The key of the next value in the enclosing object.
  JsonWriter& key(const std::string& k) {
    separate();
    quoted(k);
    out_ += ':';
    after_key_ = true;
    return *this;
  }
  JsonWriter& value(const std::string& s) { return scalar([&] { quoted(s); }); }
  JsonWriter& value(const char* s) { return s ? value(std::string(s)) : null(); }
  JsonWriter& value(bool b) { return scalar([&] { out_ += b ? "true" : "false"; }); }
  JsonWriter& value(int v) { return value(static_cast<long long>(v)); }
  JsonWriter& value(long long v) { return scalar([&] { out_ += std::to_string(v); }); }
  JsonWriter& value(unsigned long long v) { return scalar([&] { out_ += std::to_string(v); }); }
  JsonWriter& value(double v) {
    return scalar([&] {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.6g", v);
      out_ += buf;
    });
  }
  JsonWriter& null() { return scalar([&] { out_ += "null"; }); }
  // A piece that is already JSON (a node's report made on another rank).
  JsonWriter& raw(const std::string& json) { return scalar([&] { out_ += json; }); }
  template <class T>
  JsonWriter& field(const std::string& k, const T& v) {
    key(k);
    return value(v);
  }

  const std::string& str() const { return out_; }

 private:
  JsonWriter& open(char c) {
    separate();
    out_ += c;
    first_.push_back(true);
    return *this;
  }
  JsonWriter& close(char c) {
    out_ += c;
    first_.pop_back();
    return *this;
  }
  template <class F>
  JsonWriter& scalar(F&& write) {
    separate();
    write();
    return *this;
  }
  // A comma before every element but the first; none between a key and its value.
  void separate() {
    if (after_key_) {
      after_key_ = false;
      return;
    }
    if (first_.empty()) return;
    if (!first_.back()) out_ += ',';
    first_.back() = false;
  }
  void quoted(const std::string& s) {
    out_ += '"';
    for (const char ch : s) {
      const auto c = static_cast<unsigned char>(ch);
      switch (c) {
        case '"': out_ += "\\\""; break;
        case '\\': out_ += "\\\\"; break;
        case '\n': out_ += "\\n"; break;
        case '\t': out_ += "\\t"; break;
        case '\r': out_ += "\\r"; break;
        default:
          if (c < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\u%04x", c);
            out_ += buf;
          } else {
            out_ += ch;
          }
      }
    }
    out_ += '"';
  }

  std::string out_;
  std::vector<bool> first_;
  bool after_key_ = false;
};

}  // namespace meshmem::info
