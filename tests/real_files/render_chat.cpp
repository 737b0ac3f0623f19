// Render a conversation with a GGUF's chat template the way llama-server and llama-cli do:
// llama.cpp's common chat code (common_chat_templates_init / common_chat_templates_apply) with
// the server's defaults (jinja, a generation prompt, thinking on where the template supports it).
//
//     render_chat MODEL.gguf < messages.json      (an OpenAI-style array of messages)
//
// Prints the rendered prompt, nothing else.

#include "chat.h"
#include "llama.h"

#include <cstdio>
#include <iostream>
#include <sstream>

static void quiet(ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

int main(int argc, char ** argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s MODEL.gguf < messages.json\n", argv[0]);
        return 2;
    }
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    std::stringstream in;
    in << std::cin.rdbuf();
    try {
        common_chat_templates_ptr tmpls = common_chat_templates_init(model, "");
        common_chat_templates_inputs inputs;
        inputs.messages              = common_chat_msgs_parse_oaicompat(common_json::parse(in.str()));
        inputs.use_jinja             = true;
        inputs.add_generation_prompt = true;
        inputs.enable_thinking       = common_chat_templates_support_enable_thinking(tmpls.get());
        inputs.reasoning_format      = COMMON_REASONING_FORMAT_DEEPSEEK;
        common_chat_params params    = common_chat_templates_apply(tmpls.get(), inputs);
        fwrite(params.prompt.data(), 1, params.prompt.size(), stdout);
    } catch (const std::exception & e) {
        fprintf(stderr, "error: %s\n", e.what());
        llama_model_free(model);
        return 1;
    }
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
