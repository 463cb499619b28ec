// The graph compiler (mstar::GraphBuilder): structure-only nodes compile to the IR a Model with
// functions gets, the IR it makes is one the Conductor accepts, and its messages are the Python
// DSL's (tests/python/test_graph_compiler.py checks that the DSL gets them word for word).
#include <gtest/gtest.h>

#include <string>

#include "mstar/conductor.hpp"
#include "mstar/graph_builder.hpp"
#include "mstar/model.hpp"

namespace {

using mstar::ChunkPolicy;
using mstar::Edge;
using mstar::GraphBuilder;
using mstar::GraphError;
using mstar::GraphSpec;
using mstar::kEmit;
using mstar::Section;

std::string error_of(const GraphBuilder& b) {
  try {
    (void)b.compile();
  } catch (const GraphError& e) {
    return e.what();
  }
  return "no GraphError";
}

void expect_same_ir(const GraphSpec& a, const GraphSpec& b) {
  EXPECT_EQ(a.names, b.names);
  EXPECT_EQ(a.engines, b.engines);
  ASSERT_EQ(a.nodes.size(), b.nodes.size());
  for (std::size_t i = 0; i < a.nodes.size(); ++i) {
    EXPECT_EQ(a.nodes[i].name, b.nodes[i].name);
    EXPECT_EQ(a.nodes[i].engine, b.nodes[i].engine);
    EXPECT_EQ(a.nodes[i].max_batch, b.nodes[i].max_batch);
    EXPECT_EQ(a.nodes[i].inputs, b.nodes[i].inputs);
    EXPECT_EQ(a.nodes[i].outputs, b.nodes[i].outputs);
    EXPECT_EQ(a.nodes[i].on_stream_end, b.nodes[i].on_stream_end);
  }
  ASSERT_EQ(a.walks.size(), b.walks.size());
  for (std::size_t w = 0; w < a.walks.size(); ++w) {
    EXPECT_EQ(a.walks[w].name, b.walks[w].name);
    EXPECT_EQ(a.walks[w].root, b.walks[w].root);
    EXPECT_EQ(a.walks[w].sections.size(), b.walks[w].sections.size());
    EXPECT_EQ(a.walks[w].emits, b.walks[w].emits);
    EXPECT_EQ(a.walks[w].persist, b.walks[w].persist);
    EXPECT_EQ(a.walks[w].streams.size(), b.walks[w].streams.size());
  }
}

// prefill: enc; decode: a DynamicLoop of dec streaming tokens to voc, in parallel with voc.
GraphBuilder speech_graph() {
  GraphBuilder b;
  b.input("x").input("s");
  b.node("enc", {"x"}, {Edge::persisted("dec", "h")});
  b.node("dec", {"h", "s"},
         {Edge::output("s"), Edge::emit("tok"), Edge::stream("voc", "tok", ChunkPolicy::fixed(2))},
         "default", 8);
  b.node("voc", {"tok"}, {Edge::emit("audio")}, "audio", 1, true);
  b.walk("prefill", "enc");
  b.walk("decode", Section::par({Section::dynamic_loop("gen", "dec", 16, {"s"}), "voc"}));
  return b;
}

TEST(GraphBuilder, StructureOnlyNodesCompileToTheIrAModelWithFunctionsGets) {
  auto noop = [](mstar::NodeCall&) {};
  mstar::Model m;
  m.input("x").input("s");
  m.node("enc", {"x"}, {Edge::persisted("dec", "h")}, noop);
  mstar::NodeOptions dec, voc;
  dec.max_batch = 8;
  voc.engine = "audio";
  m.node("dec", {"h", "s"},
         {Edge::output("s"), Edge::emit("tok"), Edge::stream("voc", "tok", ChunkPolicy::fixed(2))},
         noop, dec);
  m.node("voc", {"tok"}, {Edge::emit("audio")}, noop, voc);
  m.on_stream_end("voc", noop);
  m.walk("prefill", "enc");
  m.walk("decode", Section::par({Section::dynamic_loop("gen", "dec", 16, {"s"}), "voc"}));
  expect_same_ir(speech_graph().compile(), m.compile());
}

TEST(GraphBuilder, MakesAnIrTheConductorAccepts) {
  const GraphSpec ir = speech_graph().compile();
  EXPECT_EQ(ir.engines, (std::vector<std::string>{"default", "audio"}));
  EXPECT_EQ(ir.nodes[1].max_batch, 8u);
  EXPECT_TRUE(ir.nodes[2].on_stream_end);
  ASSERT_EQ(ir.walks[1].streams.size(), 1u);
  EXPECT_NO_THROW(mstar::Conductor{ir});
}

TEST(GraphBuilder, APlainOutputIsReadByLaterNodesByName) {
  GraphBuilder b;
  b.input("x").node("a", {"x"}, {Edge::output("y")}).node("b", {"y"}, {Edge::emit("z")});
  b.walk("w", Section::seq({"a", "b"}));
  EXPECT_NO_THROW((void)b.compile());
  b.walk("v", "b");  // not after 'a' here: 'y' has no producer in this walk
  EXPECT_EQ(error_of(b), "node 'b' in walk 'v' reads 'y', which no node produces; add an edge "
                         "named 'y' or rename the input");
}

TEST(GraphBuilder, SpeaksTheWordsOfThePythonDsl) {
  GraphBuilder emit;
  emit.input("x").node("a", {"x"}, {Edge::stream(kEmit, "tok", ChunkPolicy::fixed(2))});
  emit.walk("w", "a");
  EXPECT_EQ(error_of(emit), "streaming edge 'tok' from 'a' goes to EMIT; stream to a consumer "
                            "node, or use GraphEdge(EMIT, ...) to emit each value");
  GraphBuilder both;
  both.input("x").node("a", {"x"}, {Edge::output("v"), Edge::output("u")});
  both.walk("w", Section::loop("a", 2, {"v", "u"}, {"u", "v"}));
  EXPECT_EQ(error_of(both), "Loop in walk 'w' lists ['u', 'v'] as both an output and an "
                            "accumulated output; choose one (last value or every value)");
}

TEST(GraphBuilder, RefusesANodeInNoWalk) {
  // A node in no walk never runs: its outputs never come, with nothing said. A node in a
  // Part's sub-walk of another walk counts as walked.
  GraphBuilder b;
  b.input("x")
      .node("a", {"x"}, {Edge::emit("y")})
      .node("b", {"x"}, {Edge::emit("z")})
      .node("c", {"x"}, {Edge::emit("u")})
      .walk("w", "a");
  EXPECT_EQ(error_of(b), "nodes ['b', 'c'] are in no walk, so they would never run; put each in "
                         "a walk or leave it out of the model's nodes");
  GraphBuilder placed = b;  // placement's parent: 'c' runs in a worker's segment
  placed.elsewhere("c");
  EXPECT_EQ(error_of(placed), "nodes ['b'] are in no walk, so they would never run; put each in "
                              "a walk or leave it out of the model's nodes");
  b.walk("v", Section::part("p", {{"one", "b"}, {"two", "c"}}));
  EXPECT_EQ(error_of(b), "no GraphError");
}

TEST(GraphBuilder, RefusesLoopCountsAndBatchLimitsOutOfRange) {
  for (std::int64_t n : {std::int64_t{0}, std::int64_t{-1}, std::int64_t{1} << 32}) {
    GraphBuilder b;
    b.input("x").node("a", {"x"}, {Edge::emit("y")}).walk("w", Section::loop("a", n));
    EXPECT_NE(error_of(b).find("Loop in walk 'w' has max_iters=" + std::to_string(n)),
              std::string::npos) << error_of(b);
  }
  GraphBuilder b;
  b.input("x").node("a", {"x"}, {Edge::emit("y")}, "default", 0).walk("w", "a");
  EXPECT_EQ(error_of(b), "node 'a' has max_batch 0; it must be >= 1");
}

}  // namespace
