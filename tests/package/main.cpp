// Streams 10,000 int32 samples from a producer thread through a StreamBuffer with the Orpheus
// window (28, 7) and checks that every chunk holds exactly its positions. Exit code 0 = pass.
#include <mstar/stream_buffer.hpp>

#include <cstdint>
#include <cstdio>
#include <thread>

int main() {
  constexpr std::int32_t kItems = 10000;
  mstar::StreamBuffer stream(sizeof(std::int32_t), 64, mstar::ChunkPolicy::sliding_window(28, 7));
  std::thread producer([&] {
    for (std::int32_t i = 0; i < kItems; ++i) stream.push(&i, 1);
    stream.close();
  });
  std::uint64_t chunks = 0, fresh = 0;
  mstar::ChunkView view;
  while (stream.next_chunk(&view) == mstar::WaitStatus::ready) {
    const auto* items = reinterpret_cast<const std::int32_t*>(view.data);
    for (std::size_t k = 0; k < view.chunk.size(); ++k) {
      if (items[k] != static_cast<std::int32_t>(view.chunk.begin + k)) {
        std::fprintf(stderr, "chunk %llu: item %zu is %d\n",
                     static_cast<unsigned long long>(view.chunk.index), k, items[k]);
        return 1;
      }
    }
    fresh += view.chunk.new_size();
    ++chunks;
    stream.release_chunk();
  }
  producer.join();
  std::printf("consumer: %llu chunks, %llu items, policy %s\n",
              static_cast<unsigned long long>(chunks), static_cast<unsigned long long>(fresh),
              stream.policy().describe().c_str());
  return fresh == static_cast<std::uint64_t>(kItems) ? 0 : 1;
}
