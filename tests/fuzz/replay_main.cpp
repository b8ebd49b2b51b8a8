// Replays a fuzz target over a corpus without libFuzzer (the ctest entries fuzz_replay_<name>).
//
//   fuzz_replay_http DIR_OR_FILE...
//
// Every file is fed to LLVMFuzzerTestOneInput as it is, then as 64 mutations drawn from a fixed
// seed (bytes flipped, cut, repeated, spliced with another file), so the sanitizer builds also
// see inputs near the corpus. A crash or a sanitizer report fails the run; an empty corpus is an
// error too (a replay of nothing proves nothing).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void feed(const std::string& s) {
  // A copy in a buffer of exactly its size, so ASan catches a read one byte past the end.
  std::vector<uint8_t> exact(s.begin(), s.end());
  LLVMFuzzerTestOneInput(exact.data(), exact.size());
}

std::string mutate(std::string s, const std::string& other, std::mt19937_64& rng) {
  auto pick = [&](size_t n) { return n == 0 ? 0 : static_cast<size_t>(rng() % n); };
  const int edits = 1 + static_cast<int>(rng() % 4);
  for (int e = 0; e < edits; ++e) {
    switch (rng() % 5) {
      case 0:  // flip a byte
        if (!s.empty()) s[pick(s.size())] = static_cast<char>(rng());
        break;
      case 1:  // cut the tail
        s.resize(pick(s.size() + 1));
        break;
      case 2: {  // repeat a slice
        const size_t at = pick(s.size() + 1), len = pick(s.size() - at + 1);
        s.insert(at, s.substr(at, len));
        break;
      }
      case 3:  // splice in part of another input
        s.insert(pick(s.size() + 1), other.substr(0, pick(other.size() + 1)));
        break;
      default:  // an interesting byte
        s.insert(pick(s.size() + 1), 1, "\r\n\0 :*$+-9"[pick(10)]);
        break;
    }
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> inputs;
  for (int i = 1; i < argc; ++i) {
    const std::filesystem::path arg(argv[i]);
    if (std::filesystem::is_directory(arg)) {
      for (const auto& e : std::filesystem::recursive_directory_iterator(arg)) {
        if (e.is_regular_file()) inputs.push_back(read_file(e.path()));
      }
    } else {
      inputs.push_back(read_file(arg));
    }
  }
  if (inputs.empty()) {
    std::fprintf(stderr, "fuzz replay: no inputs (usage: %s DIR_OR_FILE...)\n", argv[0]);
    return 2;
  }
  std::mt19937_64 rng(20261121);
  size_t runs = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    feed(inputs[i]);
    ++runs;
    for (int m = 0; m < 64; ++m) {
      feed(mutate(inputs[i], inputs[rng() % inputs.size()], rng));
      ++runs;
    }
  }
  std::printf("fuzz replay: %zu inputs, %zu runs, no failure\n", inputs.size(), runs);
  return 0;
}
