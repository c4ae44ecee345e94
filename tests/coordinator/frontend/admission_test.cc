// frontend::Admission, the step both front ends share: a valid request becomes the expected
// SequenceRequest (the prompt as the tokenizer / chat template make it, the default max_tokens,
// the tool-call constraint), and every invalid one is refused naming its field as each API spells
// it (the gRPC API's and the OpenAI API's tables), the field attached for the HTTP "param". The
// model: the qwen2 test tokenizer with Qwen2.5-Instruct's chat template (hermes tool calls).
#include "coordinator/frontend/admission.h"
#include "coordinator/frontend/allowed_tokens.h"
#include "coordinator/frontend/bad_words.h"

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/harmony_model.h"
#include "tests/testing/rejection_counter.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace shardserve::coordinator::frontend {
namespace {

using ::shardserve::testing::IsOk;
using ::shardserve::testing::RejectionCounter;
using ::shardserve::testing::StatusIs;
using ::testing::HasSubstr;
using Json = nlohmann::ordered_json;

constexpr int64_t kContext = 2048;  // the chat prompt with two tools is ~800 tokens

// A request's constraint (built member by member: GCC 12 warns of a braced temporary's string).
std::optional<ConstraintInput> Constraint(structured::ConstraintKind kind, std::string text, std::string field) {
  std::optional<ConstraintInput> c;
  c.emplace();
  c->spec.kind = kind;
  c->spec.text = std::move(text);
  c->field = std::move(field);
  return c;
}

class AdmissionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_.Write("tokenizer.json", testing::ReadFileOrEmpty("tests/golden/models/qwen2/tokenizer.json"));
    Json config;
    config["chat_template"] = testing::ReadFileOrEmpty("tests/coordinator/http/chat_templates/qwen2.5_instruct.jinja");
    dir_.Write("tokenizer_config.json", config.dump());
    absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = LoadTokenizer(dir_.path());
    ASSERT_THAT(tokenizer.status(), IsOk());
    tokenizer_ = *std::move(tokenizer);
    compiler_ = std::make_unique<structured::ConstraintCompiler>(
        structured::VocabularyFromTokenizer(*tokenizer_, tokenizer_->vocab_size()));
    admission_ = Make(tokenizer_.get(), compiler_.get());
  }

  std::unique_ptr<Admission> Make(const Tokenizer* tokenizer, structured::ConstraintCompiler* compiler) {
    return std::make_unique<Admission>(AdmissionOptions{
        .tokenizer = tokenizer,
        .model_path = dir_.path(),
        .constraints = compiler,
        .limits = {.vocab_size = tokenizer_->vocab_size(), .max_seq_len = kContext},
        .eos_token_ids = {eos_},
        .ready = [this] { return ready_; },
        .observer = &observer_});
  }

  // A valid text request.
  static AdmissionRequest Text(std::string text = "Hello world") {
    AdmissionRequest r;
    r.prompt = std::move(text);
    r.max_tokens = 8;
    return r;
  }

  static Json Tools() {
    return Json::parse(R"([
      {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}},
      {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}])");
  }

  // A valid chat request with the two tools (tool choice auto).
  static AdmissionRequest Chat() {
    ChatInput chat;
    chat.turns.push_back({.role = "user", .content = "Weather in Paris?"});
    chat.tools = Tools();
    for (const Json& t : chat.tools) {
      chat.functions.push_back(*ParseToolDefinition(t, "tools"));
    }
    chat.tool_choice = ToolChoice::kAuto;
    AdmissionRequest r;
    r.prompt = std::move(chat);
    r.max_tokens = 8;
    return r;
  }

  testing::TempDir dir_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<structured::ConstraintCompiler> compiler_;
  std::unique_ptr<Admission> admission_;
  RejectionCounter observer_;
  absl::Status ready_ = absl::OkStatus();
  int32_t eos_ = 0;
};

TEST_F(AdmissionTest, TextRequestBecomesTheSequenceRequest) {
  AdmissionRequest r = Text("Once upon a time");
  r.sequence.request_id = "req-7";
  r.sequence.sampling = {.temperature = 0.7f, .top_k = 40, .top_p = 0.9f, .seed = 5, .min_p = 0.1f,
                         .logit_bias = {{9, 1.0f}, {3, -2.0f}}, .presence_penalty = 0.5f,
                         .frequency_penalty = 0.25f, .repetition_penalty = 1.1f};
  r.sequence.stop_token_ids = {4};
  r.sequence.min_tokens = 2;
  r.sequence.logprobs = true;
  r.sequence.top_logprobs = 3;
  r.stop = {"The end"};
  r.n = 3;
  ASSERT_OK_AND_ASSIGN(AdmittedRequest a, admission_->Admit(r, GrpcFieldNames()));
  ASSERT_OK_AND_ASSIGN(std::vector<int32_t> want, tokenizer_->Encode("Once upon a time", /*add_special_tokens=*/true));
  EXPECT_EQ(a.sequence.prompt, want);
  EXPECT_EQ(a.sequence.request_id, "req-7");
  EXPECT_EQ(a.sequence.max_tokens, 8);
  EXPECT_EQ(a.sequence.sampling.temperature, 0.7f);
  EXPECT_EQ(a.sequence.sampling.top_k, 40);
  EXPECT_EQ(a.sequence.sampling.top_p, 0.9f);
  EXPECT_EQ(a.sequence.sampling.seed, 5u);
  EXPECT_EQ(a.sequence.sampling.repetition_penalty, 1.1f);
  // logit_bias sorted by token id.
  EXPECT_EQ(a.sequence.sampling.logit_bias, (std::vector<std::pair<int32_t, float>>{{3, -2.0f}, {9, 1.0f}}));
  EXPECT_EQ(a.sequence.stop_token_ids, std::vector<int32_t>{4});
  EXPECT_EQ(a.sequence.min_tokens, 2);
  EXPECT_TRUE(a.sequence.logprobs);
  EXPECT_EQ(a.sequence.top_logprobs, 3);
  EXPECT_EQ(a.sequence.constraint, nullptr);
  EXPECT_EQ(a.stop, std::vector<std::string>{"The end"});
  EXPECT_EQ(a.n, 3);
  EXPECT_FALSE(a.tool_calls.has_value());
  EXPECT_FALSE(a.resumed_end.has_value());
  EXPECT_EQ(observer_.total(), 0);
}

// A model whose chat template writes GPT-OSS's harmony format: its chat answers are always split
// by their channels (whatever --reasoning_parser says when it says nothing), decoded with the
// special tokens the split reads, and end at the model's <|call|>; an enforced call is refused.
// A template that teaches GLM-4.5's call format: its chats with tools are parsed as glm45 calls
// (typed by the request's tools), decoded with special tokens (its call tags may be special
// tokens), and an enforced call is refused, naming tool_choice.
TEST_F(AdmissionTest, Glm45ChatsKeepTheirCallTagsAndTypeTheirArguments) {
  testing::TempDir dir;
  dir.Write("tokenizer.json", testing::ReadFileOrEmpty("tests/golden/models/qwen2/tokenizer.json"));
  Json config;
  config["chat_template"] =
      "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{% endfor %}<|assistant|>"
      "{% if tools %}<tool_call>{name}\n<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>{% endif %}";
  dir.Write("tokenizer_config.json", config.dump());
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Tokenizer> tokenizer, LoadTokenizer(dir.path()));
  structured::ConstraintCompiler compiler(structured::VocabularyFromTokenizer(*tokenizer, tokenizer->vocab_size()));
  Admission admission(AdmissionOptions{.tokenizer = tokenizer.get(),
                                       .model_path = dir.path(),
                                       .constraints = &compiler,
                                       .limits = {.vocab_size = tokenizer->vocab_size(), .max_seq_len = kContext}});
  EXPECT_EQ(admission.tool_format(), ToolCallFormat::kGlm45);
  AdmissionRequest r = Chat();
  ASSERT_OK_AND_ASSIGN(AdmittedRequest a, admission.Admit(r, OpenAiFieldNames(/*chat=*/true)));
  EXPECT_EQ(a.tool_calls, ToolCallFormat::kGlm45);
  EXPECT_FALSE(a.skip_special_tokens);
  ASSERT_EQ(a.tools.size(), std::get<ChatInput>(r.prompt).functions.size());
  EXPECT_EQ(a.tools[0].name, std::get<ChatInput>(r.prompt).functions[0].name);
  // Without tools the answer is decoded as asked.
  AdmissionRequest plain = Chat();
  std::get<ChatInput>(plain.prompt).tools = Json();
  std::get<ChatInput>(plain.prompt).functions.clear();
  std::get<ChatInput>(plain.prompt).tool_choice = ToolChoice::kNone;
  ASSERT_OK_AND_ASSIGN(AdmittedRequest p, admission.Admit(plain, OpenAiFieldNames(/*chat=*/true)));
  EXPECT_FALSE(p.tool_calls.has_value());
  EXPECT_TRUE(p.skip_special_tokens);
  EXPECT_TRUE(p.tools.empty());
  AdmissionRequest required = Chat();
  std::get<ChatInput>(required.prompt).tool_choice = ToolChoice::kRequired;
  EXPECT_THAT(admission.Admit(required, OpenAiFieldNames(/*chat=*/true)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::AllOf(HasSubstr("tool_choice"), HasSubstr("GLM-4.5"))));
}

TEST_F(AdmissionTest, HarmonyChatsReadTheirChannelsAndStopAtACall) {
  testing::TempDir dir;
  dir.Write("tokenizer.json", testing::HarmonyTokenizerJson());
  Json config;
  config["chat_template"] = testing::HarmonyChatTemplate();
  ASSERT_FALSE(config["chat_template"].get<std::string>().empty());
  dir.Write("tokenizer_config.json", config.dump());
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Tokenizer> tokenizer, LoadTokenizer(dir.path()));
  ASSERT_EQ(tokenizer->PieceToId("<|call|>"), testing::kHarmonyCallId);
  structured::ConstraintCompiler compiler(structured::VocabularyFromTokenizer(*tokenizer, tokenizer->vocab_size()));
  auto make = [&](std::optional<ReasoningFormat> reasoning) {
    return std::make_unique<Admission>(AdmissionOptions{
        .tokenizer = tokenizer.get(),
        .model_path = dir.path(),
        .constraints = &compiler,
        .reasoning = reasoning,
        .limits = {.vocab_size = tokenizer->vocab_size(), .max_seq_len = kContext}});
  };
  std::unique_ptr<Admission> admission = make(std::nullopt);
  EXPECT_EQ(admission->reasoning(), ReasoningFormat::kHarmony);
  EXPECT_EQ(admission->tool_format(), ToolCallFormat::kHarmony);

  AdmissionRequest r = Chat();
  r.sequence.stop_token_ids = {7};
  ASSERT_OK_AND_ASSIGN(AdmittedRequest a, admission->Admit(r, OpenAiFieldNames(/*chat=*/true)));
  EXPECT_EQ(a.reasoning, ReasoningFormat::kHarmony);
  EXPECT_EQ(a.tool_calls, ToolCallFormat::kHarmony);
  EXPECT_FALSE(a.skip_special_tokens);
  EXPECT_EQ(a.sequence.stop_token_ids, (std::vector<int32_t>{7, testing::kHarmonyCallId}));
  // The prompt ends where the answer's header starts: "<|start|>assistant".
  ASSERT_OK_AND_ASSIGN(std::vector<int32_t> tail, tokenizer->Encode("<|start|>assistant", false));
  ASSERT_GE(a.sequence.prompt.size(), tail.size());
  EXPECT_TRUE(std::equal(tail.begin(), tail.end(), a.sequence.prompt.end() - static_cast<ptrdiff_t>(tail.size())));
  EXPECT_EQ(tail.front(), 256);  // <|start|> is one special token

  EXPECT_EQ(a.harmony_opened, "");
  auto ends_with = [&](const std::vector<int32_t>& prompt, const std::string& text) {
    absl::StatusOr<std::vector<int32_t>> ids = tokenizer->Encode(text, false);
    return ids.ok() && prompt.size() >= ids->size() &&
           std::equal(ids->begin(), ids->end(), prompt.end() - static_cast<ptrdiff_t>(ids->size()));
  };
  // Structured output: the prompt opens the final channel, and the constraint shapes its text.
  AdmissionRequest shaped = Chat();
  shaped.constraint = Constraint(structured::ConstraintKind::kJsonSchema, R"({"type": "object"})", "response_format");
  ASSERT_OK_AND_ASSIGN(AdmittedRequest b, admission->Admit(shaped, OpenAiFieldNames(/*chat=*/true)));
  EXPECT_EQ(b.reasoning, ReasoningFormat::kHarmony);
  EXPECT_EQ(b.harmony_opened, "<|channel|>final");
  EXPECT_NE(b.sequence.constraint, nullptr);
  EXPECT_TRUE(ends_with(b.sequence.prompt, "<|start|>assistant<|channel|>final<|message|>"));
  EXPECT_EQ(b.sequence.prompt.size(), a.sequence.prompt.size() + 7);  // <|channel|>, five bytes of "final", <|message|>
  // A named tool: the prompt opens a call of it, and its arguments are the constraint.
  AdmissionRequest named = Chat();
  std::get<ChatInput>(named.prompt).tool_choice = ToolChoice::kNamed;
  std::get<ChatInput>(named.prompt).tool_name = "get_time";
  ASSERT_OK_AND_ASSIGN(AdmittedRequest n, admission->Admit(named, OpenAiFieldNames(/*chat=*/true)));
  EXPECT_EQ(n.reasoning, ReasoningFormat::kHarmony);
  EXPECT_EQ(n.tool_calls, ToolCallFormat::kHarmony);
  EXPECT_EQ(n.harmony_opened, "<|channel|>commentary to=functions.get_time <|constrain|>json");
  EXPECT_NE(n.sequence.constraint, nullptr);
  EXPECT_TRUE(ends_with(n.sequence.prompt, "<|start|>assistant<|channel|>commentary to=functions.get_time "
                                           "<|constrain|>json<|message|>"));
  // A completion is not a chat.
  ASSERT_OK_AND_ASSIGN(AdmittedRequest c, admission->Admit(Text(), OpenAiFieldNames(/*chat=*/false)));
  EXPECT_FALSE(c.reasoning.has_value());
  EXPECT_TRUE(c.sequence.stop_token_ids.empty());

  // A named call where the prompt opens no new message (continue_final_message): refused.
  AdmissionRequest continued = named;
  ChatInput& continued_chat = std::get<ChatInput>(continued.prompt);
  continued_chat.turns.push_back({.role = "assistant", .content = "{\"zone\": "});
  continued_chat.add_generation_prompt = false;
  continued_chat.continue_final_message = true;
  EXPECT_THAT(admission->Admit(continued, OpenAiFieldNames(/*chat=*/true)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tool_choice: a named tool call is enforced in the harmony format only where the "
                                 "prompt opens a new assistant message")));
  // "required" (any function) cannot be enforced: refused, naming tool_choice.
  std::get<ChatInput>(r.prompt).tool_choice = ToolChoice::kRequired;
  EXPECT_THAT(admission->Admit(r, OpenAiFieldNames(/*chat=*/true)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tool_choice: \"required\" cannot be enforced in GPT-OSS's harmony format")));

  // An explicit --reasoning_parser stands.
  EXPECT_EQ(make(ReasoningFormat::kQwen3)->reasoning(), ReasoningFormat::kQwen3);
  // Other templates are not split unless asked.
  EXPECT_FALSE(admission_->reasoning().has_value());
}

TEST_F(AdmissionTest, TokenIdsAreUsedAsGivenAndMaxTokensDefaultsToTheRestOfTheContext) {
  AdmissionRequest r;
  r.prompt = std::vector<int32_t>{5, 6, 7};
  ASSERT_OK_AND_ASSIGN(AdmittedRequest a, admission_->Admit(r, OpenAiFieldNames(/*chat=*/true)));
  EXPECT_EQ(a.sequence.prompt, (std::vector<int32_t>{5, 6, 7}));
  EXPECT_EQ(a.sequence.max_tokens, kContext - 3);
}

TEST_F(AdmissionTest, ChatIsRenderedWithItsToolsAndRequiredCallsAreConstrained) {
  AdmissionRequest r = Chat();
  ASSERT_OK_AND_ASSIGN(AdmittedRequest a, admission_->Admit(r, OpenAiFieldNames(/*chat=*/true)));
  const ChatInput& chat = std::get<ChatInput>(r.prompt);
  ASSERT_OK_AND_ASSIGN(std::string text,
                       ChatPrompt(tokenizer_.get(), dir_.path()).RenderText(chat.turns, {.tools = chat.tools}));
  EXPECT_THAT(text, HasSubstr("get_weather"));  // the template lists the tools
  ASSERT_OK_AND_ASSIGN(std::vector<int32_t> want, tokenizer_->Encode(text, /*add_special_tokens=*/false));
  EXPECT_EQ(a.sequence.prompt, want);
  EXPECT_EQ(a.tool_calls, ToolCallFormat::kHermes);  // detected from Qwen2.5's template
  EXPECT_EQ(a.sequence.constraint, nullptr);        // auto: the model decides

  std::get<ChatInput>(r.prompt).tool_choice = ToolChoice::kRequired;
  ASSERT_OK_AND_ASSIGN(AdmittedRequest required, admission_->Admit(r, GrpcFieldNames()));
  EXPECT_NE(required.sequence.constraint, nullptr);
  EXPECT_EQ(required.sequence.prompt, want);

  // Tool choice none: the tools are shown, the answer is not parsed.
  std::get<ChatInput>(r.prompt).tool_choice = ToolChoice::kNone;
  ASSERT_OK_AND_ASSIGN(AdmittedRequest none, admission_->Admit(r, GrpcFieldNames()));
  EXPECT_FALSE(none.tool_calls.has_value());
  EXPECT_EQ(none.sequence.prompt, want);
}

TEST_F(AdmissionTest, ConstraintIsCompiled) {
  AdmissionRequest r = Text();
  r.constraint = Constraint(structured::ConstraintKind::kRegex, "[a-z]{3}", "regex");
  ASSERT_OK_AND_ASSIGN(AdmittedRequest a, admission_->Admit(r, GrpcFieldNames()));
  EXPECT_NE(a.sequence.constraint, nullptr);
}

// vLLM's allowed_token_ids: a constraint of one state that allows exactly those ids, and leaves the
// EOS ids to the usual stop rules (it does not decide them, so min_tokens still suppresses them).
TEST_F(AdmissionTest, AllowedTokenIdsBecomeAConstraintThatLeavesEosToTheStopRules) {
  AdmissionRequest r = Text();
  r.allowed_token_ids = {5, 200, 5, eos_};
  ASSERT_OK_AND_ASSIGN(AdmittedRequest a, admission_->Admit(r, OpenAiFieldNames(false)));
  const std::shared_ptr<const TokenConstraint>& c = a.sequence.constraint;
  ASSERT_NE(c, nullptr);
  EXPECT_FALSE(c->DecidesEos());
  const int32_t start = c->StartState();
  const std::string& mask = *c->AllowedMask(start);
  ASSERT_EQ(static_cast<int64_t>(mask.size()), (tokenizer_->vocab_size() + 7) / 8);
  std::vector<int32_t> allowed;
  for (int32_t t = 0; t < tokenizer_->vocab_size(); ++t) {
    if ((static_cast<unsigned char>(mask[t / 8]) >> (t % 8)) & 1u) allowed.push_back(t);
  }
  EXPECT_EQ(allowed, (std::vector<int32_t>{eos_, 5, 200}));
  EXPECT_EQ(c->Advance(start, 200), start);
  EXPECT_EQ(c->Advance(start, eos_), start);
  EXPECT_FALSE(c->IsFinished(c->Advance(start, eos_)));
  EXPECT_EQ(c->Advance(start, 6), -1);
  EXPECT_EQ(c->Advance(start, -1), -1);
  // Structured output's constraints decide the EOS ids.
  AdmissionRequest s = Text();
  s.constraint = Constraint(structured::ConstraintKind::kRegex, "[a-z]{3}", "regex");
  ASSERT_OK_AND_ASSIGN(AdmittedRequest b, admission_->Admit(s, GrpcFieldNames()));
  EXPECT_TRUE(b.sequence.constraint->DecidesEos());
}

// One invalid request: how it is made, and the field each API names.
struct InvalidCase {
  const char* what;
  std::function<void(AdmissionRequest&)> spoil;
  bool chat;
  const char* grpc_field;    // GrpcFieldNames()
  const char* openai_field;  // OpenAiFieldNames(chat)
  const char* message;       // in both messages
};

// vLLM's truncate_prompt_tokens: the last k tokens of a longer prompt, of any kind; -1 the last
// ones that fit beside max_tokens (or one token).
// vLLM's bad_words: each word (leading whitespace dropped) as the tokenizer spells it alone, and
// after a space where that spelling has as many tokens and starts with another one. A byte-level
// BPE tokenizer with merges spells "Lily" and " Lily" with one token each.
TEST(BadWordSequencesTest, WordsAreBannedAsSpelledAloneAndAfterASpace) {
  testing::TempDir dir;
  dir.Write("tokenizer.json", testing::ReadFileOrEmpty("tests/golden/tokenizers/bytelevel_qwen2/tokenizer.json"));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Tokenizer> tokenizer, LoadTokenizer(dir.path()));
  auto encode = [&](std::string_view text) { return *tokenizer->Encode(text, /*add_special_tokens=*/false); };
  const std::vector<int32_t> lily = encode("Lily");
  const std::vector<int32_t> spaced_lily = encode(" Lily");
  ASSERT_EQ(lily.size(), 1u);
  ASSERT_EQ(spaced_lily.size(), 1u);
  ASSERT_NE(lily, spaced_lily);
  // " happy day" is two tokens of their own; "happy day" alone is spelled otherwise.
  const std::vector<int32_t> day = encode("happy day");
  const std::vector<int32_t> spaced_day = encode(" happy day");
  ASSERT_EQ(spaced_day.size(), 2u);
  std::vector<std::vector<int32_t>> expected = {lily, spaced_lily, day};
  if (day.size() == spaced_day.size() && day.front() != spaced_day.front()) expected.push_back(spaced_day);
  ASSERT_OK_AND_ASSIGN(std::vector<std::vector<int32_t>> banned,
                       BadWordSequences(*tokenizer, std::vector<std::string>{"  Lily", "happy day"}, "bad_words"));
  EXPECT_EQ(banned, expected);
}

// Admission tokenizes the request's bad words into its SequenceRequest.
TEST_F(AdmissionTest, BadWordsBecomeTheSequencesTokenSequences) {
  AdmissionRequest r = Text();
  r.bad_words = {"ab", " cd"};
  ASSERT_OK_AND_ASSIGN(AdmittedRequest a, admission_->Admit(r, GrpcFieldNames()));
  ASSERT_OK_AND_ASSIGN(std::vector<std::vector<int32_t>> expected,
                       BadWordSequences(*tokenizer_, r.bad_words, "bad_words"));
  EXPECT_EQ(a.sequence.bad_words, expected);
  EXPECT_EQ(expected.size(), 2u);  // bytes only: " ab" is longer than "ab"
}

TEST_F(AdmissionTest, TruncatePromptTokensKeepsThePromptsLastTokens) {
  std::vector<int32_t> ids(100);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i + 10);
  AdmissionRequest r;
  r.prompt = ids;
  r.max_tokens = 8;
  r.truncate_prompt_tokens = 30;
  ASSERT_OK_AND_ASSIGN(AdmittedRequest a, admission_->Admit(r, GrpcFieldNames()));
  EXPECT_EQ(a.sequence.prompt, std::vector<int32_t>(ids.end() - 30, ids.end()));
  EXPECT_TRUE(a.prompt_truncated);
  r.truncate_prompt_tokens = 100;  // not longer: as it is
  ASSERT_OK_AND_ASSIGN(a, admission_->Admit(r, GrpcFieldNames()));
  EXPECT_EQ(a.sequence.prompt, ids);
  EXPECT_FALSE(a.prompt_truncated);
  // -1: a prompt longer than the context keeps what fits beside max_tokens; without max_tokens,
  // beside one token.
  std::vector<int32_t> longer(kContext + 50, 7);
  longer.back() = 9;
  r.prompt = longer;
  r.truncate_prompt_tokens = -1;
  r.max_tokens = 48;
  ASSERT_OK_AND_ASSIGN(a, admission_->Admit(r, GrpcFieldNames()));
  EXPECT_EQ(a.sequence.prompt.size(), static_cast<size_t>(kContext - 48));
  EXPECT_EQ(a.sequence.prompt.back(), 9);
  EXPECT_EQ(a.sequence.max_tokens, 48);
  r.max_tokens.reset();
  ASSERT_OK_AND_ASSIGN(a, admission_->Admit(r, GrpcFieldNames()));
  EXPECT_EQ(a.sequence.prompt.size(), static_cast<size_t>(kContext - 1));
  EXPECT_EQ(a.sequence.max_tokens, 1);
  // A text prompt and a chat prompt are cut after they are tokenized or rendered.
  AdmissionRequest text = Text("Once upon a time there was a little girl");
  text.truncate_prompt_tokens = 3;
  ASSERT_OK_AND_ASSIGN(std::vector<int32_t> whole,
                       tokenizer_->Encode("Once upon a time there was a little girl", /*add_special_tokens=*/true));
  ASSERT_OK_AND_ASSIGN(a, admission_->Admit(text, OpenAiFieldNames(false)));
  EXPECT_EQ(a.sequence.prompt, std::vector<int32_t>(whole.end() - 3, whole.end()));
  AdmissionRequest chat = Chat();
  ASSERT_OK_AND_ASSIGN(AdmittedRequest full, admission_->Admit(chat, OpenAiFieldNames(true)));
  chat.truncate_prompt_tokens = 5;
  ASSERT_OK_AND_ASSIGN(a, admission_->Admit(chat, OpenAiFieldNames(true)));
  EXPECT_EQ(a.sequence.prompt, std::vector<int32_t>(full.sequence.prompt.end() - 5, full.sequence.prompt.end()));
}

TEST_F(AdmissionTest, InvalidRequestsNameTheFieldAsEachApiSpellsIt) {
  auto chat_of = [](AdmissionRequest& r) -> ChatInput& { return std::get<ChatInput>(r.prompt); };
  const InvalidCase cases[] = {
      {"top_p", [](AdmissionRequest& r) { r.sequence.sampling.top_p = 1.5f; }, false, "sampling.top_p", "top_p",
       "must be in (0, 1]"},
      {"temperature", [](AdmissionRequest& r) { r.sequence.sampling.temperature = -1.0f; }, false,
       "sampling.temperature", "temperature", "must be a finite number >= 0"},
      {"top_k", [](AdmissionRequest& r) { r.sequence.sampling.top_k = -1; }, false, "sampling.top_k", "top_k",
       "must be >= 0"},
      {"min_p", [](AdmissionRequest& r) { r.sequence.sampling.min_p = 2.0f; }, false, "sampling.min_p", "min_p",
       "must be in [0, 1]"},
      {"logit_bias id", [](AdmissionRequest& r) { r.sequence.sampling.logit_bias = {{1 << 30, 1.0f}}; }, false,
       "sampling.logit_bias", "logit_bias", "is outside the vocabulary"},
      {"presence_penalty", [](AdmissionRequest& r) { r.sequence.sampling.presence_penalty = 3.0f; }, false,
       "sampling.presence_penalty", "presence_penalty", "must be in [-2, 2]"},
      {"stop_token_ids", [](AdmissionRequest& r) { r.sequence.stop_token_ids = {-1}; }, false, "stop_token_ids",
       "stop_token_ids", "[0] = -1 is outside the vocabulary"},
      {"min_tokens", [](AdmissionRequest& r) { r.sequence.min_tokens = 9; }, false, "min_tokens", "min_tokens",
       "= 8], got 9"},
      {"top_logprobs (completions)", [](AdmissionRequest& r) { r.sequence.top_logprobs = 21; }, false,
       "top_logprobs", "logprobs", "must be in [0, 20]"},
      {"top_logprobs (chat)", [](AdmissionRequest& r) { r.sequence.top_logprobs = 21; }, true, "top_logprobs",
       "top_logprobs", "must be in [0, 20]"},
      {"prompt id", [](AdmissionRequest& r) { r.prompt = std::vector<int32_t>{1, 1 << 30}; }, false,
       "prompt.token_ids", "prompt", "[1] = 1073741824 is outside the vocabulary"},
      {"empty ids", [](AdmissionRequest& r) { r.prompt = std::vector<int32_t>{}; }, false, "prompt", "prompt",
       "is empty"},
      {"long prompt", [](AdmissionRequest& r) { r.prompt = std::vector<int32_t>(kContext, 5); }, false, "prompt",
       "prompt", "is too long"},
      {"max_tokens (chat)", [](AdmissionRequest& r) { r.max_tokens = kContext; }, true,
       "max_tokens", "max_tokens", "exceeds the context"},
      {"max_tokens 0", [](AdmissionRequest& r) { r.max_tokens = 0; }, false, "max_tokens", "max_tokens",
       "must be >= 1, got 0"},
      {"max_tokens", [](AdmissionRequest& r) { r.max_tokens = int64_t{1} << 40; }, false, "max_tokens",
       "max_tokens", "exceeds the context"},
      {"n", [](AdmissionRequest& r) { r.n = 17; }, false, "n", "n", "must be in [1, 16], got 17"},
      {"truncate 0", [](AdmissionRequest& r) { r.truncate_prompt_tokens = 0; }, false, "truncate_prompt_tokens",
       "truncate_prompt_tokens", "must be -1 (what fits the context) or >= 1, got 0"},
      {"truncate -2", [](AdmissionRequest& r) { r.truncate_prompt_tokens = -2; }, false, "truncate_prompt_tokens",
       "truncate_prompt_tokens", "got -2"},
      {"stop", [](AdmissionRequest& r) { r.stop = {"x", ""}; }, false, "stop", "stop", "stop[1] is empty"},
      {"resume with n", [](AdmissionRequest& r) { r.sequence.resumed = {5}; r.n = 2; }, false, "resume.token_ids",
       "resume", "only a request with n = 1 can be resumed"},
      {"resume token", [](AdmissionRequest& r) { r.sequence.resumed = {-3}; }, false, "resume.token_ids[0]",
       "resume.token_ids[0]", "outside"},
      {"constraint", [](AdmissionRequest& r) { r.constraint = Constraint(structured::ConstraintKind::kRegex, "(a", "guided_regex"); },
       false, "guided_regex", "guided_regex", ""},
      {"role", [&](AdmissionRequest& r) { chat_of(r).turns[0].role = "robot"; }, true, "prompt.chat", "messages",
       "messages[0].role must be"},
      {"no tools", [&](AdmissionRequest& r) { chat_of(r).tools = nullptr; chat_of(r).functions.clear(); }, true,
       "prompt.chat.tool_choice", "tool_choice", ": needs "},
      {"unknown tool", [&](AdmissionRequest& r) { chat_of(r).tool_choice = ToolChoice::kNamed; chat_of(r).tool_name = "div"; },
       true, "prompt.chat.tool_choice", "tool_choice", "no tool is named 'div'"},
      {"two tools of one name", [&](AdmissionRequest& r) { chat_of(r).functions[1].name = "get_weather"; }, true,
       "prompt.chat.tools[1]", "tools[1]", "two tools are named 'get_weather'"},
      {"allowed id", [](AdmissionRequest& r) { r.allowed_token_ids = {5, 1 << 30}; }, false, "allowed_token_ids[1]",
       "allowed_token_ids[1]", " = 1073741824 is outside the vocabulary"},
      {"allowed ids", [](AdmissionRequest& r) { r.allowed_token_ids.assign(kMaxAllowedTokenIds + 1, 5); }, false,
       "allowed_token_ids", "allowed_token_ids", "at most 1048576 are taken"},
      {"allowed with a constraint",
       [](AdmissionRequest& r) {
         r.allowed_token_ids = {5};
         r.constraint = Constraint(structured::ConstraintKind::kJsonObject, "", "response_format");
       },
       false, "allowed_token_ids", "allowed_token_ids", "cannot be combined with response_format"},
      {"allowed with a required tool call",
       [&](AdmissionRequest& r) {
         r.allowed_token_ids = {5};
         chat_of(r).tool_choice = ToolChoice::kRequired;
       },
       true, "allowed_token_ids", "allowed_token_ids", "tool_choice"},
      {"allowed stops under min_tokens",
       [this](AdmissionRequest& r) {
         r.allowed_token_ids = {eos_, 7};
         r.sequence.stop_token_ids = {7};
         r.sequence.min_tokens = 2;
       },
       false, "allowed_token_ids", "allowed_token_ids", "only stop and EOS ids, which min_tokens = 2"},
      {"a template variable the server sets",
       [&](AdmissionRequest& r) { chat_of(r).template_kwargs = {{"tools", 1}}; }, true, "prompt.chat.template_kwargs",
       "chat_template_kwargs", "'tools' is set by the server"},
      {"template kwargs not an object", [&](AdmissionRequest& r) { chat_of(r).template_kwargs = Json::array(); }, true,
       "prompt.chat.template_kwargs", "chat_template_kwargs", "must be a JSON object"},
      {"an empty bad word", [](AdmissionRequest& r) { r.bad_words = {"fine", " \t"}; }, false, "bad_words[1]",
       "bad_words[1]", "is empty (or only whitespace)"},
      {"a long bad word", [](AdmissionRequest& r) { r.bad_words = {std::string(kMaxBadWordBytes + 1, 'a')}; }, false,
       "bad_words[0]", "bad_words[0]", "is 257 bytes long"},
      {"too many bad words", [](AdmissionRequest& r) { r.bad_words.assign(kMaxBadWords + 1, "x"); }, false,
       "bad_words", "bad_words", "holds 257 words; at most 256"},
      {"a bad word of many tokens",
       [](AdmissionRequest& r) {
         const std::string marks = "!#%&*+-/<=>?@^|~";
         std::string word;  // 160 bytes of marks in varying pairs: far more than 64 tokens
         for (size_t i = 0; i < 160; ++i) word += marks[(i * 7 + i / 16) % marks.size()];
         r.bad_words = {"ok", word};
       },
       false, "bad_words[1]", "bad_words[1]", "tokens; it must be 1 to 64"},
      {"a bad word of bad UTF-8", [](AdmissionRequest& r) { r.bad_words = {"ok", "\xff\xfe"}; }, false, "bad_words[1]",
       "bad_words[1]", ": "},
      {"required with a constraint",
       [&](AdmissionRequest& r) {
         chat_of(r).tool_choice = ToolChoice::kRequired;
         r.constraint = Constraint(structured::ConstraintKind::kJsonObject, "", "response_format");
       },
       true, "prompt.chat.tool_choice", "tool_choice", "cannot be combined with response_format"},
  };
  for (const InvalidCase& c : cases) {
    for (const bool grpc : {true, false}) {
      SCOPED_TRACE(absl::StrCat(c.what, grpc ? " (gRPC)" : " (OpenAI)"));
      AdmissionRequest r = c.chat ? Chat() : Text();
      c.spoil(r);
      const FieldNames& names = grpc ? GrpcFieldNames() : OpenAiFieldNames(c.chat);
      const std::string field = grpc ? c.grpc_field : c.openai_field;
      const int before = observer_.total();
      absl::StatusOr<AdmittedRequest> a = admission_->Admit(r, names);
      ASSERT_THAT(a.status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message)));
      // The message starts with the field; the field is attached (without an index, as HTTP's param).
      EXPECT_TRUE(absl::StartsWith(a.status().message(), field)) << a.status();
      const std::string attached = RequestFieldOf(a.status());
      EXPECT_TRUE(absl::StartsWith(field, attached) && !attached.empty()) << attached;
      EXPECT_EQ(observer_.total(), before + 1);  // reported
    }
  }
}

TEST_F(AdmissionTest, WithoutTokenizerOrCompilerTextStopStringsAndConstraintsAreRefused) {
  std::unique_ptr<Admission> bare = Make(nullptr, nullptr);
  EXPECT_THAT(bare->Admit(Text(), GrpcFieldNames()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("prompt.text: the model has no tokenizer")));
  AdmissionRequest ids;
  ids.prompt = std::vector<int32_t>{1, 2};
  ids.max_tokens = 4;
  EXPECT_THAT(bare->Admit(ids, GrpcFieldNames()).status(), IsOk());
  AdmissionRequest stop = ids;
  stop.stop = {"x"};
  absl::Status st = bare->Admit(stop, OpenAiFieldNames(false)).status();
  EXPECT_THAT(st, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("stop: the model has no tokenizer")));
  EXPECT_EQ(RequestFieldOf(st), "stop");
  AdmissionRequest constrained = ids;
  constrained.constraint = Constraint(structured::ConstraintKind::kJsonObject, "", "json_object");
  EXPECT_THAT(bare->Admit(constrained, GrpcFieldNames()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("json_object: structured output needs")));
  AdmissionRequest banned = ids;
  banned.bad_words = {"x"};
  st = bare->Admit(banned, OpenAiFieldNames(true)).status();
  EXPECT_THAT(st, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bad_words: the model has no tokenizer")));
  EXPECT_EQ(RequestFieldOf(st), "bad_words");
}

TEST_F(AdmissionTest, ReadinessIsAskedLastOnlyForValidRequests) {
  ready_ = absl::UnavailableError("waiting for 1 worker");
  AdmissionRequest bad = Text();
  bad.n = 0;
  EXPECT_THAT(admission_->Admit(bad, GrpcFieldNames()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("n must be in")));
  EXPECT_THAT(admission_->Admit(Text(), GrpcFieldNames()).status(),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("waiting for 1 worker")));
  EXPECT_EQ(observer_.total(), 2);
}

TEST_F(AdmissionTest, ResumedTokensThatEndTheRequestAreReported) {
  AdmissionRequest r;
  r.prompt = std::vector<int32_t>{5, 6};
  r.max_tokens = 2;
  r.sequence.resumed = {7, 8};  // max_tokens of them
  ASSERT_OK_AND_ASSIGN(AdmittedRequest a, admission_->Admit(r, GrpcFieldNames()));
  EXPECT_EQ(a.resumed_end, FinishReason::kLength);
  r.sequence.resumed = {7, eos_};  // the EOS id last
  ASSERT_OK_AND_ASSIGN(a, admission_->Admit(r, GrpcFieldNames()));
  EXPECT_EQ(a.resumed_end, FinishReason::kStop);
  r.sequence.resumed = {7};
  ASSERT_OK_AND_ASSIGN(a, admission_->Admit(r, GrpcFieldNames()));
  EXPECT_FALSE(a.resumed_end.has_value());
  EXPECT_EQ(a.sequence.resumed, std::vector<int32_t>{7});
}

}  // namespace
}  // namespace shardserve::coordinator::frontend
